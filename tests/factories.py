"""Small factories shared by tests: tiny random Llama models, runner configs."""
from __future__ import annotations

import torch


def tiny_llama_config(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, max_pos=512, seed_range=0.2):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, initializer_range=seed_range, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def tiny_llama(attn: str = "sdpa", seed: int = 0, **overrides):
    """A random tiny Llama in float32; initializer_range is large enough that greedy argmax has no near-ties."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    config = tiny_llama_config(**overrides)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model
