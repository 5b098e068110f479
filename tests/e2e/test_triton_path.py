"""The data plane with the Triton kernels forced on CPU (Triton's interpreter) gives the same greedy
tokens as the CPU path (the C++ kernel for decode rows and short prompt runs), through HTTP
against real processes, on a tiny random Llama."""
import urllib.request

import pytest
import torch

from tests.e2e.client import post_many
from tests.servers import Server

pytestmark = pytest.mark.slow


def test_triton_interpreter_path_matches_torch_path(tiny_model_dir, tmp_path):
    args = ["--model", tiny_model_dir, "--num-threads", "1", "--block-size", "8", "--kv-cache-blocks", "64",
            "--max-num-batched-tokens", "24"]
    torch_path = Server("torch-path", args, str(tmp_path), env={"PAGEDSERVE_TRITON": "0"})
    triton_path = Server("triton-path", args, str(tmp_path), env={"PAGEDSERVE_TRITON": "1", "TRITON_INTERPRET": "1"})
    try:
        torch_path.wait_ready()
        triton_path.wait_ready()
        # prompts long enough to be chunked (budget 24) and to span partial blocks of 8
        bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                  for p in ["Hello there, how are you doing today my friend?", "One two three",
                            "The quick brown fox jumps over the lazy dog again and again and again."]]
        want = post_many(torch_path.url, "/v1/completions", bodies)
        got = post_many(triton_path.url, "/v1/completions", bodies)
        for (s1, d1), (s2, d2) in zip(want, got):
            assert s1 == s2 == 200, (d1, d2)
            assert d1["choices"][0]["token_ids"] == d2["choices"][0]["token_ids"]
            assert len(d1["choices"][0]["token_ids"]) == 6
        assert "attention ops: triton" in triton_path.log()
        assert "attention ops: cpu kernel for decode rows and prompt runs of up to" in torch_path.log()
    finally:
        torch_path.stop()
        triton_path.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_server_matches_cpu_server(tiny_model_dir, tmp_path):
    """The data plane on the GPU (compiled Triton kernels, KV pool in device memory, swap through
    pinned host memory) gives the CPU server's greedy tokens; the pool is small enough that
    sequences are preempted and swapped."""
    common = ["--model", tiny_model_dir, "--num-threads", "1", "--block-size", "16", "--kv-cache-blocks", "12",
              "--max-num-batched-tokens", "64", "--swap-space-gib", "0.05"]
    cpu = Server("cpu", [*common, "--device", "cpu"], str(tmp_path))
    gpu = Server("cuda", [*common, "--device", "cuda"], str(tmp_path))
    try:
        cpu.wait_ready()
        gpu.wait_ready()
        bodies = [{"prompt": f"Request {i}: count slowly from {i} and say why " * (1 + i % 3), "max_tokens": 40,
                   "temperature": 0, "ignore_eos": True, "return_token_ids": True} for i in range(8)]
        want = post_many(cpu.url, "/v1/completions", bodies)
        got = post_many(gpu.url, "/v1/completions", bodies)
        for (s1, d1), (s2, d2) in zip(want, got):
            assert s1 == s2 == 200, (d1, d2)
            assert d2["choices"][0]["token_ids"] == d1["choices"][0]["token_ids"]
        assert "attention ops: triton" in gpu.log_all() and "on cuda" in gpu.log_all()
        with urllib.request.urlopen(gpu.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        swapped_in = [line for line in metrics.splitlines()
                      if line.startswith("pagedserve_swap_blocks_total") and 'direction="in"' in line]
        assert swapped_in and float(swapped_in[0].split()[-1]) > 0, swapped_in
    finally:
        cpu.stop()
        gpu.stop()
