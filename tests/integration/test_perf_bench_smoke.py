"""The performance benchmarks run end to end on CI-sized inputs (`--quick`) and print what they promise.

Each loads SmolLM2 twice (a served data plane and an in-process transformers model, in parallel),
so each takes about a minute on 2 idle cores. One torch thread per process: on a busy machine,
two OpenMP threads per process can run many times slower than one (see _common.cpu_check).
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(name: str, *extra: str) -> str:
    cmd = [sys.executable, os.path.join("bench", name), "--quick", "--num-threads", "1", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    return done.stdout


def number_after(pattern: str, text: str) -> float:
    match = re.search(pattern + r"\s*([0-9.]+)", text)
    assert match, f"no {pattern!r} in:\n{text}"
    return float(match.group(1))


@pytest.mark.slow
def test_throughput_quick():
    out = run_bench("throughput.py")
    for system in ("(a) pagedserve", "(b) transformers generate", "(c) transformers continuous batching"):
        assert system in out, out
    assert number_after(r"\(a\) pagedserve, REST API, all requests at once\s+[0-9.]+", out) > 0
    assert number_after(r"ratio \(a\)/\(b\):", out) > 0
    # (c) either ran and has a ratio, or the output says why it could not run
    assert "ratio (a)/(c):" in out or "(c) transformers continuous batching (generation thread)" \
        " not run:" in out, out
    # (v) vLLM either ran or says why not (its venv is set up by bench/vllm_setup.sh, not by CI)
    assert "ratio (a)/(v):" in out or re.search(r"\(v\) vLLM CPU build.* not run: .*vllm_setup", out), out
    # greedy float32 on prompts of equal length (no padding): the same tokens as transformers
    assert "token check (a) vs (b): 0 of 8 requests differ" in out, out
    assert "cpu check" in out and "machine:" in out


@pytest.mark.slow
def test_overhead_quick():
    out = run_bench("overhead.py")
    for label in ("decode 1 x ctx 32", "decode 4 x ctx 32", "prefill 1 x 64"):
        rows = [line for line in out.splitlines() if line.startswith(label)]
        assert len(rows) == 3, f"{label}: expected a ratio, a breakdown and a runner row in:\n{out}"
        cells = [row[len(label):].split() for row in rows]
        bare_ms, engine_ms, ratio = (float(x) for x in cells[0][1:4])
        assert bare_ms > 0 and engine_ms > 0 and ratio > 0, rows[0]
        breakdown = [float(x) for x in cells[1]]
        assert len(breakdown) == 7 and breakdown[5] > 0, rows[1]   # the data plane's forward took time
    assert "goal <= 1.15" in out


def test_cpu_kernels_quick():
    out = run_bench("cpu_kernels.py")
    # one attention row and two linear rows, each with a speedup and a small output difference
    rows = re.findall(r"^\s*\d+\s+(?:\d+\s+)?[0-9.]+\s+[0-9.]+\s+(?:[0-9.]+\s+[0-9.]+\s+)?([0-9.]+)x\s+([0-9.e+-]+)$",
                      out, re.M)
    assert len(rows) == 3, out
    for speedup, diff in rows:
        assert float(speedup) > 0 and float(diff) < 1e-3, out


def test_gpu_profile_imports_and_refuses_without_cuda():
    """bench/gpu_profile.py is CUDA-only: without a GPU it still imports what it uses (the other
    benches, the kernels) and says what to run instead, with exit code 2."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the profile would run for minutes")
    done = subprocess.run([sys.executable, os.path.join("bench", "gpu_profile.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs CUDA" in done.stderr and "bench/overhead.py" in done.stderr
