"""Fixtures shared by every test folder: the embedded model, and a tiny random model on disk."""
from __future__ import annotations

import os

import pytest

from shared.config import default_model_path


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(smollm_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_path):
    """A random 2-layer Llama saved as safetensors, with SmolLM2's tokenizer (so that the control
    plane can tokenize): servers on it start in seconds and steps take milliseconds."""
    from tests.helpers import save_tiny_model
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), smollm_path)


@pytest.fixture(scope="session")
def heavier_model_dir(tmp_path_factory, smollm_path):
    """The tiny model's kind, wider and deeper (hidden 1024, 4 layers, 16 query and 4 KV heads): its steps take
    tens of milliseconds, so that a test can catch a batch half way or a request outlasting a deadline
    without racing the tiny model's few milliseconds a step."""
    from tests.helpers import save_tiny_model
    return save_tiny_model(str(tmp_path_factory.mktemp("heavier-llama")), smollm_path, hidden=1024, layers=4,
                           heads=16, kv_heads=4)


@pytest.fixture(scope="session")
def smol_tokenizer(smollm_path):
    """SmolLM2's tokenizer (its chat template prints only roles and contents: no tools)."""
    from transformers import AutoTokenizer
    folder, name = os.path.split(smollm_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def api_server(smol_tokenizer):
    """The REST API in this process over a tiny random model with SmolLM2's tokenizer (see
    tests/inproc_server.py): real clients, no second process."""
    from tests.inproc_server import InProcessServer
    server = InProcessServer(smol_tokenizer).start()
    try:
        yield server
    finally:
        server.stop()
