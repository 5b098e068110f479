"""`pagedserve serve` with several data-plane replicas, and with a tensor-parallel data plane,
as real processes over HTTP on the tiny random model."""
import json
import os
import random
import re
import signal
import time

import pytest
import torch

from tests.e2e.client import get, post_many, post_one
from tests.servers import Server

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def body(prompt_ids):
    return {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def expected_text(tiny_hf, prompt_ids):
    model, tok = tiny_hf
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                         min_new_tokens=MAX_TOKENS, do_sample=False)
    # the server holds back an incomplete UTF-8 character at the end (random tokens make some)
    return tok.decode(out[0, len(prompt_ids):], skip_special_tokens=True).rstrip("\ufffd")


def received_by_replica(url) -> dict[str, float]:
    status, text = get(url, "/metrics")
    assert status == 200
    found = re.findall(r'pagedserve_requests_received_total\{[^}]*replica="(\d+)"[^}]*\} ([0-9.]+)', text)
    return {replica: float(value) for replica, value in found}


@pytest.fixture(scope="module")
def two_replicas(tiny_model_dir, tmp_path_factory):
    server = Server("replicas", ["--model", tiny_model_dir, "--num-threads", "1", "--data-parallel-size", "2",
                                 "--kv-cache-blocks", "128"], str(tmp_path_factory.mktemp("replicas")))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_two_replicas_serve_every_request_alike_and_share_the_load(two_replicas, tiny_hf):
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    before = received_by_replica(two_replicas.url)
    assert sorted(before) == ["0", "1"]
    results = post_many(two_replicas.url, "/v1/completions", [body(p) for p in prompts])
    assert [status for status, _ in results] == [200] * len(prompts)
    assert [data["choices"][0]["text"].rstrip("\ufffd") for _, data in results] == [expected_text(tiny_hf, p) for p in prompts]
    after = received_by_replica(two_replicas.url)
    spread = {r: after[r] - before[r] for r in after}
    assert sum(spread.values()) == len(prompts) and min(spread.values()) >= 2, spread


def test_shared_prefix_requests_land_on_one_replica(two_replicas, tiny_hf):
    rng = random.Random(4)
    prefix = [rng.randrange(100, 49152) for _ in range(48)]        # three full blocks of 16
    prompts = [prefix + [rng.randrange(100, 49152) for _ in range(5)] for _ in range(4)]
    before = received_by_replica(two_replicas.url)
    results = post_many(two_replicas.url, "/v1/completions", [body(p) for p in prompts])
    assert [data["choices"][0]["text"].rstrip("\ufffd") for _, data in results] == [expected_text(tiny_hf, p) for p in prompts]
    after = received_by_replica(two_replicas.url)
    spread = sorted(after[r] - before[r] for r in after)
    assert spread == [0, len(prompts)]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_tensor_parallel_serve_recovers_when_a_rank_dies(tiny_model_dir, tiny_hf, tmp_path):
    server = Server("tp", ["--model", tiny_model_dir, "--num-threads", "1", "--tensor-parallel-size", "2",
                           "--kv-cache-blocks", "64"], str(tmp_path))
    try:
        server.wait_ready()
        status, version = get(server.url, "/version")
        assert status == 200 and "x2 tensor-parallel ranks" in json.loads(version)["device"]
        prompt = list(range(200, 230))
        status, data, _ = post_one(server.url, "/v1/completions", body(prompt))
        assert status == 200 and data["choices"][0]["text"].rstrip("\ufffd") == expected_text(tiny_hf, prompt)
        (rank0,) = _children(server.proc.pid)
        (rank1,) = _children(rank0)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{rank0}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{rank0}/cmdline") or _is_zombie(rank0), "rank 0 outlived rank 1"
        deadline = time.monotonic() + 120        # new requests get 503 until the restarted group answers
        while get(server.url, "/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        status, data, _ = post_one(server.url, "/v1/completions", body(prompt))
        assert status == 200 and data["choices"][0]["text"].rstrip("\ufffd") == expected_text(tiny_hf, prompt)
        assert "restarting it" in server.log_all()
        (new_rank0,) = _children(server.proc.pid)
        assert new_rank0 != rank0 and len(_children(new_rank0)) == 1
    finally:
        server.stop()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
