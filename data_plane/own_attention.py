"""Attention layers that compute attention in their own code (BLOOM, MPT, Falcon), run on the paged cache.

transformers' BLOOM, MPT and Falcon layers do not call the attention interface: they multiply Q and K
themselves (BLOOM and MPT adding an ALiBi bias tensor the base model materialized for the whole
context; Falcon after its rotary embedding, its query heads over one or a few KV heads; from
transformers 5.25 Falcon calls the interface and is served through it, as Llama is). While such
a model runs on pagedserve's attention (a step or the start-time probe is under way: transformers
cannot switch these models' attention implementation), each of those layers runs the forward below: the layer's own projections and clipping up to attention, then
`paged_attention_forward` (data_plane/attention.py) with the layer's ALiBi slopes, which the kernels
apply per head and per distance, then the layer's own output projection. Otherwise (transformers'
`generate`, for one) the layer runs its own forward, unchanged.

The slopes are the ones transformers' code computes for the model, read from its own functions: the
bias it adds, slope * key position (BLOOM) or slope * (key position - last position) (MPT), differs from
the kernels' slope * (key position - query position) by a constant per query, which softmax ignores.
"""
from __future__ import annotations

import functools

import torch

from data_plane import attention

_INSTALLED = "_pagedserve_own_attention"
_SLOPES = "_pagedserve_alibi"


def _bloom_slopes(module, config, device):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    return _get_alibi_slopes(config.n_head, device).float()


def _mpt_slopes(module, config, device):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    # the bias of the key one before the last is -slope (build_mpt_alibi_tensor puts 0 at the last)
    bias = build_mpt_alibi_tensor(config.n_heads, 2, config.attn_config.alibi_bias_max, device)
    return -bias[:, 0, 0].float()


def _slopes(module, config, device, make) -> torch.Tensor:
    cached = module.__dict__.get(_SLOPES)
    if cached is None or cached.device != device:
        cached = make(module, config, device).contiguous()
        module.__dict__[_SLOPES] = cached
    return cached


def _bloom_forward(module, config, hidden_states, residual, alibi, attention_mask, layer_past=None,
                   use_cache=False, output_attentions=False, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add
    batch, tokens, _ = hidden_states.shape
    query, key, value = module._reshape(module.query_key_value(hidden_states))   # [1, heads, tokens, dim] each
    out, _ = attention.paged_attention_forward(
        module, query, key, value, None, scaling=module.inv_norm_factor,
        alibi=_slopes(module, config, hidden_states.device, _bloom_slopes))
    output = module.dense(out.reshape(batch, tokens, module.hidden_size))
    return dropout_add(output, residual, module.hidden_dropout, module.training), None


def _falcon_forward(module, config, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                    use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb
    batch, tokens, _ = hidden_states.shape
    fused = module.query_key_value(hidden_states)
    if module.new_decoder_architecture:
        # per KV head: its group of query heads, then its K and V (transformers broadcasts K and V to
        # every query head; the pool keeps one per KV head, as grouped-query attention reads them)
        qkv = fused.view(batch, tokens, -1, module.num_heads // module.num_kv_heads + 2, module.head_dim)
        query, key, value = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        query, key, value = module._split_heads(fused)   # multi-query: one K and V head
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))   # [1, heads, tokens, dim]
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    out, _ = attention.paged_attention_forward(module, query, key, value, None, scaling=module.inv_norm_factor)
    return module.dense(out.reshape(batch, tokens, -1)), None


def _mpt_forward(module, config, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    batch, tokens = hidden_states.shape[:2]
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (t.reshape(batch, tokens, module.n_heads, module.head_dim).transpose(1, 2)
                         for t in mixed.chunk(3, dim=2))
    out, _ = attention.paged_attention_forward(
        module, query, key, value, None, scaling=module.softmax_scale,
        alibi=_slopes(module, config, hidden_states.device, _mpt_slopes))
    return module.out_proj(out.reshape(batch, tokens, -1)), None


# attention class -> the forward that runs it on the paged cache
FORWARDS = {"BloomAttention": _bloom_forward, "MptAttention": _mpt_forward, "FalconAttention": _falcon_forward}
# the model types whose ALiBi is served here
ALIBI_MODEL_TYPES = {"bloom", "mpt"}


def _falcon_has_own_attention() -> bool:
    """Before transformers 5.25 Falcon's layers computed attention themselves, their class looked up in
    a table by implementation name; from 5.25 one class calls the attention interface, which serves it
    as it serves Llama (rotary applied, K and V per KV head), and the table is gone."""
    from transformers.models.falcon import modeling_falcon
    return hasattr(modeling_falcon, "FALCON_ATTENTION_CLASSES")


def register_classes() -> None:
    """Lets Falcon be built with pagedserve's attention where it has its table of attention classes: ours
    builds the eager class, whose forward install() replaces."""
    if _falcon_has_own_attention():
        from transformers.models.falcon import modeling_falcon
        modeling_falcon.FALCON_ATTENTION_CLASSES.setdefault(attention.ATTENTION_NAME, modeling_falcon.FalconAttention)


def _dispatch(module, own, paged, config, *args, **kwargs):
    if attention.active():
        return paged(module, config, *args, **kwargs)
    return own(*args, **kwargs)


def install(model) -> None:
    """Gives every attention layer of `model` that computes attention itself the paged forward above,
    used while the model runs on pagedserve's attention (once per model).

    A model loaded with pagedserve's attention implementation goes back to "eager": these layers ignore
    the setting, and the base model's own code needs the dense causal mask eager builds (MPT's casts it)."""
    found = False
    falcon = _falcon_has_own_attention()   # else its layers call the attention interface
    for module in model.modules():
        name = type(module).__name__
        paged = FORWARDS.get(name) if falcon or name != "FalconAttention" else None
        if paged is not None:
            found = True
            if not module.__dict__.get(_INSTALLED):
                module.forward = functools.partial(_dispatch, module, module.forward, paged, model.config)
                module.__dict__[_INSTALLED] = True
    if found and model.config._attn_implementation == attention.ATTENTION_NAME:
        model.config._attn_implementation = "eager"
    config = model.config
    if config.model_type == "falcon" and getattr(config, "num_key_value_heads", None) is None:
        # the KV heads its layers hand to attention, under the name the runner sizes the pool by
        config.num_key_value_heads = config.num_kv_heads if config.new_decoder_architecture else \
            1 if config.multi_query else config.num_attention_heads
