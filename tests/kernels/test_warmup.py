"""ops.warmup runs every Triton kernel once, leaves the cache as it was, and only where kernels are compiled."""
import time

import pytest
import torch

from ops import warmup
from ops.attention import choose


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_warm_up_runs_each_kernel_and_writes_nothing(kt, monkeypatch, dtype):
    import pagedserve_kernels.cache_ops as co
    import pagedserve_kernels.paged_attention as pa
    calls = []
    for module, name in ((pa, "paged_decode"), (pa, "paged_prefill"), (co, "write_kv_triton"),
                         (co, "copy_blocks_triton")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    gen = torch.Generator(kt.device).manual_seed(0)
    # two layers, K and V; on a GPU the kernels are compiled, on CPU interpreted
    caches = [torch.randn(6, 16, 2, 64, generator=gen, device=kt.device).to(dtype) for _ in range(4)]
    before = [c.clone() for c in caches]
    started = time.perf_counter()
    seconds = warmup.run_each_kernel(caches, num_heads=4)
    elapsed = time.perf_counter() - started
    assert 0 < seconds <= elapsed       # it times its own work, within the call
    assert sorted(set(calls)) == ["copy_blocks_triton", "paged_decode", "paged_prefill", "write_kv_triton"]
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_runner_warms_up_only_on_cuda_with_triton(monkeypatch):
    """On CPU (even with the Triton path chosen at start, interpreted) nothing is compiled, so no warm-up."""
    from tests.helpers import make_runner, paged_model
    called = []
    monkeypatch.setattr(warmup, "run_each_kernel", lambda *a, **k: called.append(1) or 0.0)
    monkeypatch.setenv("PAGEDSERVE_TRITON", "1")
    make_runner(paged_model(seed=0), block_size=8)
    triton = choose(torch.device("cpu"), torch.float32, triton=True)
    assert warmup.warm_up([torch.zeros(2, 8, 1, 16)] * 2, num_heads=2, backend=triton) is None
    assert called == []
