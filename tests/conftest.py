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
    from transformers import AutoTokenizer

    from tests.helpers import tiny_llama
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    model = tiny_llama(vocab_size=49152, hidden=256, heads=4, kv_heads=2, layers=2, max_pos=512)
    model.save_pretrained(folder)
    tok_dir, gguf = os.path.split(smollm_path)
    AutoTokenizer.from_pretrained(tok_dir, gguf_file=gguf).save_pretrained(folder)
    return folder
