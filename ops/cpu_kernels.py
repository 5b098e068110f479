"""The CPU kernels (pagedserve_kernels/cpu/): paged decode attention and the few-row linear. Built once with
torch's extension builder, then loaded from its cache.

    python -m ops.cpu_kernels        # build now (`make install` does this), print where it lives

The build needs a C++ compiler and ninja (a pip dependency) and took 41 s on two idle cores; later loads take milliseconds. Without a compiler, or with PAGEDSERVE_CPU_KERNELS=0,
the data plane falls back to the torch reference (ops/reference.py) and says so in its log.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

log = logging.getLogger("pagedserve.ops")

_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pagedserve_kernels", "cpu")
SOURCES = [os.path.join(_FOLDER, name) for name in ("bindings.cpp", "paged_decode.cpp", "skinny_linear.cpp", "fused_ops.cpp", "coded_linear.cpp", "bf16_linear.cpp", "amx_linear.cpp",
                                                           "bf16_dots_linear.cpp", "greedy_head.cpp", "coded_layers.cpp", "sampler.cpp")]


# The CPU the kernels are built for (gcc's -march): `native` takes the paths this CPU has (AVX-512, or AVX2,
# FMA and F16C, or none). Another target builds another CPU's paths: `x86-64-v3` the AVX2 ones on an AVX-512
# machine, so that they are checked where no AVX2-only machine is at hand (docs/operations.md); empty: no -march.
MARCH = os.environ.get("PAGEDSERVE_CPU_KERNELS_MARCH", "native")


def _sources_digest() -> str:
    import hashlib
    digest = hashlib.sha256(_FOLDER.encode())   # torch's builder also keys on the include path
    for path in sorted(SOURCES + [os.path.join(_FOLDER, h) for h in ("simd.h", "aten.h", "coded_layers.h")]):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(f"-march={MARCH}".encode())   # a build for another CPU has a name of its own beside the native one
    return digest.hexdigest()[:10]


# The build cache is per user, not per checkout: a name that carries the digest of the sources and of
# the checkout's folder keeps two versions of the kernels (two checkouts, or an upgrade beside a
# running server) from rebuilding over each other, so a process never loads a module built from other
# sources than its own. The folder counts because torch's builder keys a build on its include path
# too: two worktrees with the same sources rebuilt one another's module, one of them holding the
# build lock while the other waited.
NAME = f"pagedserve_cpu_kernels_{_sources_digest()}"
# torch's builder serializes builds with a lock file; a process killed mid-build (SIGKILL, or
# SIGTERM without a handler) leaves it behind and every later start would wait on it forever
STALE_LOCK_SECONDS = 600
_state: dict = {}


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


def load():
    """The extension module, or None (disabled, or the build failed: see `failure()`)."""
    if not enabled():
        return None
    if "module" not in _state:
        _state["module"], _state["failure"] = _build()
    return _state["module"]


def failure() -> str | None:
    return _state.get("failure")


def build(name: str, sources: list[str]):
    """The extension module built from `sources` under `name` (torch's builder, its cache), with this
    project's flags; raises where the build fails."""
    from torch.utils.cpp_extension import load as build_extension
    flags = ["-O3", "-fopenmp"] + ([f"-march={MARCH}"] if MARCH else [])
    return build_extension(name, sources, extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def _build():
    try:
        _remove_stale_lock()
        started = time.perf_counter()
        module = build(NAME, SOURCES)
        log.info("CPU kernels ready in %.1f s (vectorized: %s)", time.perf_counter() - started,
                 module.vectorized())
        return module, None
    except Exception as exc:   # no compiler, no ninja, a failed build: the reference still works
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("CPU kernels unavailable, using torch ops only (%s)", message)
        return None, message


def _remove_stale_lock() -> None:
    from torch.utils.cpp_extension import _get_build_directory
    lock = os.path.join(_get_build_directory(NAME, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing a build lock left %.0f s ago by a process that did not finish: %s", age, lock)
        with contextlib.suppress(OSError):
            os.remove(lock)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("building the CPU kernels (first time only)...", flush=True)
    module = load()
    if module is None:
        print(f"not built: {failure() or 'disabled by PAGEDSERVE_CPU_KERNELS=0'}", file=sys.stderr)
        return 1
    print(f"ok: {module.__file__} (vectorized: {module.vectorized()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
