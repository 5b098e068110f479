"""Tiny random-weight models of every architecture the tests cover, built in-process (no downloads).

Shapes follow issue 11's check: hidden size 64, 2-4 layers, 4 query heads over 2 KV heads where the
architecture has grouped KV heads, head size 16, float32. Windows (12, 16 tokens) are shorter than
the tests' contexts, and Gemma 2's caps are small enough to change the result.
"""
from __future__ import annotations

import torch

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)


def _llama_like(kind: str, **extra):
    def build():
        import transformers
        config = getattr(transformers, f"{kind}Config")(**{**COMMON, **extra})
        return config, getattr(transformers, f"{kind}ForCausalLM")
    return build


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0), GPT2LMHeadModel


def _opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                     word_embed_proj_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0, init_std=0.2), OPTForCausalLM


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False), GPTNeoXForCausalLM


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    # pattern 2: sliding, full, sliding, full (real checkpoints use 6)
    return Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=12,
                            sliding_window_pattern=2, query_pre_attn_scalar=16), Gemma3ForCausalLM


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=12), \
        GptOssForCausalLM


def _llama4_text():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    # three chunked layers with rotary, one global NoPE layer whose queries are scaled by position
    # (floor_scale 8: from position 7 on, not only past 8192 as in the checkpoints)
    return Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=128,
                            num_local_experts=2, attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0],
                            floor_scale=8, attn_scale=0.5), Llama4ForCausalLM


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM
    return BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1,
                       eos_token_id=2), BloomForCausalLM


def _mpt():
    from transformers import MptConfig, MptForCausalLM
    return MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=512,
                     attn_config={"clip_qkv": 0.5}), MptForCausalLM


def _falcon(alibi=False, **extra):
    def build():
        from transformers import FalconConfig, FalconForCausalLM
        return FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            alibi=alibi, bos_token_id=1, eos_token_id=2, **extra), FalconForCausalLM
    return build


def _deepseek(version: str, q_lora_rank: int | None = None):
    def build():
        import transformers
        config = getattr(transformers, f"Deepseek{version}Config")(
            **{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=32, first_k_dense_replace=1)
        return config, getattr(transformers, f"Deepseek{version}ForCausalLM")
    return build


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM
    return MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=4), MambaForCausalLM


def _state_model(kind: str, **extra):
    """A hybrid or state-space model: layers that keep a per-sequence state (served on the state pool, or
    refused until its layers are)."""
    def build():
        import transformers
        config = getattr(transformers, f"{kind}Config")(**{**dict(vocab_size=VOCAB, hidden_size=64,
                                                                  intermediate_size=128, num_hidden_layers=2), **extra})
        return config, getattr(transformers, f"{kind}ForCausalLM")
    return build


_MAMBA2_HEADS = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)


# name -> builder of (config, causal-LM class); every one is served token-identically
SUPPORTED = {
    "Llama": _llama_like("Llama"),
    "Qwen2 (use_sliding_window)": _llama_like("Qwen2", use_sliding_window=True, sliding_window=16,
                                              max_window_layers=1, num_hidden_layers=3),
    "Qwen3": _llama_like("Qwen3", head_dim=16),
    "Mistral (window 12)": _llama_like("Mistral", sliding_window=12, head_dim=16),
    "Gemma2 (caps, alternating window)": _llama_like("Gemma2", head_dim=16, sliding_window=12, num_hidden_layers=4,
                                                     attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                     query_pre_attn_scalar=16),
    "Gemma3 (alternating window)": _gemma3,
    "Phi3 (window 12)": _llama_like("Phi3", sliding_window=12),
    "GPT-NeoX": _gpt_neox,
    "GPT-2": _gpt2,
    "OPT": _opt,
    "Granite (logits_scaling)": _llama_like("Granite", logits_scaling=4.0, attention_multiplier=0.2,
                                            embedding_multiplier=2.0, residual_multiplier=0.5),
    "Mixtral (window 16)": _llama_like("Mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                       head_dim=16),
    "OLMo2": _llama_like("Olmo2"),
    "StableLM": _llama_like("StableLm"),
    "OLMo": _llama_like("Olmo", clip_qkv=8.0),
    "Cohere (logit_scale)": _llama_like("Cohere", logit_scale=0.5),
    "Qwen2-MoE": _llama_like("Qwen2Moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64),
    "GPT-OSS (sinks, alternating window 12, MoE)": _gpt_oss,
    "SmolLM3 (NoPE layer)": _llama_like("SmolLM3", no_rope_layers=[1, 0]),
    "Qwen3-MoE": _llama_like("Qwen3Moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "GLM-4-MoE": _llama_like("Glm4Moe", head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "EXAONE 4 (alternating window 12)": _llama_like("Exaone4", head_dim=16, sliding_window=12,
                                                    sliding_window_pattern=2),
    "OLMo 3 (window 12)": _llama_like("Olmo3", sliding_window=12),
    "Seed-OSS": _llama_like("SeedOss", head_dim=16),
    "Llama 4 text (chunks of 8, NoPE layer, MoE)": _llama4_text,
    "BLOOM (ALiBi)": _bloom,
    "MPT (ALiBi, clip_qkv)": _mpt,
    "Falcon (multi-query, parallel attention)": _falcon(),
    "Falcon (new decoder architecture, 2 KV heads)": _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "DeepSeek-V2 (latent attention, K 24 wide, V 16)": _deepseek("V2"),
    "DeepSeek-V3 (latent attention, K 24 wide, V 16, q_lora)": _deepseek("V3", q_lora_rank=16),
    # convolution layers first and last, so that a state layer reads the embeddings and feeds the head
    "LFM2 (short convolutions on the state pool, attention)": _state_model(
        "Lfm2", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"]),
    "Mamba2 (SSM on the state pool, scan chunks of 8)": _state_model(
        "Mamba2", num_heads=4, head_dim=32, state_size=8, n_groups=1, chunk_size=8),
    "Granite-MoE-Hybrid (Mamba2 and attention, MoE)": _state_model(
        "GraniteMoeHybrid", num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["mamba", "attention"], mamba_chunk_size=8, **{**_MAMBA2_HEADS, "mamba_d_head": 32}),
    "Bamba (Mamba2 and attention)": _state_model(
        "Bamba", num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_chunk_size=8,
        **{**_MAMBA2_HEADS, "mamba_d_head": 32}),
    "Falcon-H1 (Mamba2 beside attention in every layer, SiLU gate)": _state_model(
        "FalconH1", num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_chunk_size=8,
        **_MAMBA2_HEADS),
    "Qwen3-Next (gated delta-net on the state pool, gated attention, MoE)": _state_model(
        "Qwen3Next", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"]),
    "Mamba (SSM on the state pool)": _mamba,
    "Jamba (Mamba with norms and attention, MoE)": _state_model(
        "Jamba", num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8),
}
def build(builder, attn: str, seed: int = 0):
    """The model in float32, eval mode, with weights drawn from `seed` (large enough that greedy
    decoding has no near-ties)."""
    config, cls = builder()
    for name in ("initializer_range", "init_std"):
        if hasattr(config, name):
            setattr(config, name, 0.2)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).eval()
    # no end-of-sequence token: generate runs every prompt to its length, as the tests' driver does
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    return GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                        window_size=8, max_position_embeddings=512, bos_token_id=1, eos_token_id=2), GPTNeoForCausalLM


STATE_MODELS = {
    # its mixer class is Mamba's with other norms, which the state pool does not compute yet
    "FalconMambaForCausalLM": _state_model("FalconMamba", state_size=4),
}


# name -> (builder, words the refusal must contain besides the architecture's name)
REFUSED = {
    "FalconForCausalLM": (_falcon(alibi=True), "adds the bias twice"),
    "GPTNeoForCausalLM": (_gpt_neo, "attention interface"),
    **{name: (builder, "per-sequence state") for name, builder in STATE_MODELS.items()},
}
