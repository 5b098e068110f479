"""Tensor parallelism on CPU with gloo: real data-plane processes, driven over ZeroMQ by the real
scheduler, give token for token what one process (and transformers' generate) gives."""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from data_plane.model_runner import ModelRunner, load_model
from data_plane.tensor_parallel import TensorParallelError, check_size
from shared.config import DataPlaneConfig
from tests.scaleout.driver import ROOT, RemoteRunner, play_greedy, start_data_plane
from tests.helpers import tiny_llama_config

PROMPTS = [[1, 5, 9, 33, 7], [1] + list(range(300, 320)), [1, 42], [1] + list(range(100, 141))]
MAX_TOKENS = 12


def address(tmp_path) -> str:
    return f"ipc://{tmp_path}/dp-{uuid.uuid4().hex[:8]}.sock"


def hf_greedy(model, prompt, max_tokens, stop_at_eos=False):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=1 if stop_at_eos else max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def until_eos(tokens, eos):
    """Our greedy outputs ignore EOS (the control plane stops there); transformers stops after it."""
    eos = {eos} if isinstance(eos, int) else set(eos)
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def save_unquantized(model, folder: str) -> None:
    """A GGUF-loaded model as plain safetensors (transformers refuses to save a GGUF-quantized model)."""
    from safetensors.torch import save_model
    os.makedirs(folder, exist_ok=True)
    save_model(model, os.path.join(folder, "model.safetensors"))
    config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    type(model.config).from_dict(config).save_pretrained(folder)


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.fixture(scope="module")
def tp2(tiny_model_dir, tmp_path_factory):
    """The tiny random model (4 query heads, 2 KV heads) on 2 ranks."""
    tmp = tmp_path_factory.mktemp("tp2")
    addr = address(tmp)
    proc = start_data_plane(tiny_model_dir, addr, "--tensor-parallel-size", "2", "--kv-cache-blocks", "64",
                            "--swap-blocks", "64", log_path=str(tmp / "dp.log"))
    try:
        yield proc, RemoteRunner(addr, timeout_s=120)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def single_tiny(tiny_model_dir):
    config = DataPlaneConfig(model=tiny_model_dir, listen="inproc://unused", kv_cache_blocks=64, swap_blocks=64)
    return ModelRunner(load_model(config, torch.device("cpu")), config, torch.device("cpu"))


@pytest.mark.slow
def test_two_ranks_hold_half_the_kv_heads_and_match_one_process(tp2, single_tiny, tiny_model_dir):
    _, runner = tp2
    assert runner.hs.num_kv_heads == 1 and "x2 tensor-parallel" in runner.hs.device
    ours, _, _ = play_greedy(runner, PROMPTS, MAX_TOKENS, num_blocks=64, budget=32)   # 41-token prompt chunked
    single, _, _ = play_greedy(single_tiny, PROMPTS, MAX_TOKENS, num_blocks=64, budget=32)
    assert ours == single
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert ours == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_ranks_under_preemption_give_the_same_tokens(tp2, single_tiny, mode):
    _, runner = tp2
    single, _, _ = play_greedy(single_tiny, PROMPTS, MAX_TOKENS, num_blocks=64, budget=32)
    # 7 blocks of 16 tokens for four sequences that grow to 17..53 tokens: someone is preempted
    ours, preemptions, swaps = play_greedy(runner, PROMPTS, MAX_TOKENS, num_blocks=7, budget=32, mode=mode,
                                           num_cpu_blocks=32 if mode == "swap" else 0)
    assert ours == single
    if mode == "swap":
        assert swaps > 0
    else:
        assert preemptions > 0 and swaps == 0


@pytest.mark.slow
def test_unseeded_sampling_keeps_every_rank_on_rank_0s_tokens(tp2, tiny_model_dir):
    """Each rank would draw its own tokens; they must all continue from rank 0's, or rank 0's next
    logits mix partial sums over different tokens. Checked against transformers, teacher-forced."""
    _, runner = tp2
    logprobs = []
    outputs, _, _ = play_greedy(runner, PROMPTS[:2], MAX_TOKENS, num_blocks=64, temperature=1.5,
                                logprobs_out=logprobs)
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, out, reported in zip(PROMPTS, outputs, logprobs):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0].float(), -1)
        want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]
        assert reported == pytest.approx(want, abs=1e-3)


@pytest.mark.slow
def test_a_dead_rank_takes_the_group_down(tp2):
    proc, runner = tp2
    (rank1,) = children_of(proc.pid)
    os.kill(rank1, signal.SIGKILL)
    assert proc.wait(timeout=15) != 0      # rank 0 exits: a control plane sees its data plane dead


def test_sizes_that_split_a_head_are_refused():
    config = tiny_llama_config(heads=9, kv_heads=3, hidden=576)
    config.intermediate_size = 1536
    check_size(config, 3)
    with pytest.raises(TensorParallelError, match=r"--tensor-parallel-size 2 does not divide .* choose one of 1, 3"):
        check_size(config, 2)


@pytest.mark.slow
def test_smollm_on_two_ranks_is_refused_at_start(smollm_path, tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "data_plane", "--model", smollm_path, "--tensor-parallel-size", "2",
                           "--listen", address(tmp_path), "--metrics-port", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--tensor-parallel-size 2 does not divide this model (9 query heads, 3 KV heads" in done.stderr
    assert "choose one of 1, 3" in done.stderr
    assert "started tensor-parallel ranks" not in done.stderr      # refused before any rank started
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_smollm_on_three_ranks_matches_transformers(smollm_path, hf_smollm, tmp_path):
    model, tok = hf_smollm
    texts = ["The capital of France is a city that many people visit because",
             "Once upon a time, in a small village by the sea, there lived",
             "Write a short poem about the moon and the stars over the"]   # 12-15 tokens: 8 more cross a block
    prompts = [tok(t)["input_ids"] for t in texts]
    eos = model.generation_config.eos_token_id
    expected = [hf_greedy(model, p, 8, stop_at_eos=True) for p in prompts]
    # the same weights as safetensors: three ranks map them instead of each de-quantizing the GGUF (~30 s)
    folder = str(tmp_path / "smollm")
    save_unquantized(model, folder)
    addr = address(tmp_path)
    proc = start_data_plane(folder, addr, "--tensor-parallel-size", "3", "--kv-cache-blocks", "32",
                            "--swap-blocks", "16", log_path=str(tmp_path / "dp.log"))
    try:
        runner = RemoteRunner(addr, timeout_s=240)
        assert runner.hs.num_kv_heads == 1
        ours, _, _ = play_greedy(runner, prompts, 8, num_blocks=32)
        assert [until_eos(o, eos) for o in ours] == expected
        # 4 blocks: three sequences start, each needs a second block, some are swapped out and back in
        swapped, _, swaps = play_greedy(runner, prompts, 8, num_blocks=4, mode="swap", num_cpu_blocks=16)
        assert [until_eos(o, eos) for o in swapped] == expected and swaps > 0
        runner.shutdown()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
