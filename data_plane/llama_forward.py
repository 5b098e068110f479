"""A lean forward pass for Llama-shaped models on the CPU in float32 (SmolLM2, the default model).

transformers' forward spends about a quarter of a small decode step outside the matrix products
(module calls, hooks, views and transposes of [batch, heads, tokens, dim] tensors). This forward
runs the same arithmetic on the flattened [tokens, ...] rows of a step with fewer calls:

- Q, K and V come from one product with the three weights stacked, and gate and up from another.
  The model's own q/k/v/gate/up weights become views into the stacked copies, so no memory is
  added and transformers' forward (model_support's probe) still runs on the same numbers;
- RMSNorm, rotary embedding, SiLU and the residual adds are transformers' own operations in the
  same order (the rotary cos/sin come from the model's own rotary module), so the numbers match
  transformers' forward up to the products' summation order, as with the routed linear layers;
- attention is the data plane's paged attention (ops/attention.py), called directly.

Only models whose every layer is the plain Llama block qualify (`build` says why not otherwise);
the others keep transformers' forward with the paged attention registered as its attention.
"""
from __future__ import annotations

import torch

from ops import linear as linear_ops
from ops.attention import paged_attention, write_kv


# steps of more rows take SiLU(gate) * up from torch (kernels/cpu/fused_ops.cpp's exp is scalar)
FUSED_SILU_MAX_ROWS = 2


def unsupported_reason(model) -> str | None:
    """None when `model` can run this forward, else why not."""
    cfg = model.config
    if type(model).__name__ != "LlamaForCausalLM" or getattr(cfg, "model_type", None) != "llama":
        return f"{type(model).__name__} is not LlamaForCausalLM"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biased projections"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    weight = model.get_output_embeddings().weight
    if not linear_ops.eligible(weight):
        return f"{weight.dtype} on {weight.device.type} (this forward is for float32 on the CPU)"
    layer = model.model.layers[0]
    if getattr(layer.self_attn, "sliding_window", None):
        return "a sliding window"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if layer.self_attn.q_proj.out_features != cfg.num_attention_heads * head_dim or \
            any(m._forward_hooks for m in model.modules()):
        # a tensor-parallel rank holds a share of the heads, and its row-parallel layers all-reduce in
        # forward hooks, which the stacked products here would not call
        return "a tensor-parallel shard"
    return None


def _stack(modules) -> torch.Tensor:
    """One [sum of outputs, in] weight, and each module's weight a view into it."""
    stacked = torch.cat([m.weight.detach() for m in modules]).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(stacked[start:start + rows], requires_grad=False)
        start += rows
    return stacked


class _Layer:
    def __init__(self, layer, kernel, packed: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.num_heads = attn.config.num_attention_heads
        self.num_kv_heads = attn.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.qkv = linear_ops.RoutedLinear(_stack([attn.q_proj, attn.k_proj, attn.v_proj]), None, kernel, packed)
        self.o = linear_ops.RoutedLinear(attn.o_proj.weight, None, kernel, packed)
        self.gate_up = linear_ops.RoutedLinear(_stack([mlp.gate_proj, mlp.up_proj]), None, kernel, packed)
        self.down = linear_ops.RoutedLinear(mlp.down_proj.weight, None, kernel, packed)
        self.act = mlp.act_fn


def _plain_silu(model) -> bool:
    return type(model.model.layers[0].mlp.act_fn).__name__ == "SiLUActivation"


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    # transformers' LlamaRMSNorm, operation for operation (float32 in, float32 out)
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class LlamaForward:
    """hidden states [tokens, hidden] of the model's last norm for one step's flattened tokens."""

    def __init__(self, model, fused: bool = True):
        self.model = model.model
        kernel = linear_ops.kernel_for([model.get_output_embeddings().weight])
        packed = linear_ops.has_packed_gemm()
        self.layers = [_Layer(layer, kernel, packed) for layer in self.model.layers]
        # the fused norm/rotary/SiLU kernels when built, else torch's operations
        self.fused = kernel if kernel is not None and _plain_silu(model) and fused else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        m = self.model
        hidden = m.embed_tokens(input_ids)                                   # [tokens, hidden]
        cos, sin = m.rotary_emb(hidden[None], position_ids=positions[None])  # [1, tokens, dim]
        if self.fused is not None:
            return self._fused_layers(hidden, cos[0].contiguous(), sin[0].contiguous(), ctx)
        return self._torch_layers(hidden, cos[0, :, None, :], sin[0, :, None, :], ctx)

    def _attend(self, index: int, layer: _Layer, q, k, v, ctx) -> torch.Tensor:
        cache = ctx.kv_pool[index]
        write_kv(k, v, cache[0], cache[1], ctx.slot_mapping)
        out = paged_attention(q, cache[0], cache[1], ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              layer.scaling, ctx.max_query_len)
        return layer.o(out.reshape(q.shape[0], layer.q_size))

    def _split(self, layer: _Layer, qkv: torch.Tensor):
        tokens = qkv.shape[0]
        q = qkv[:, :layer.q_size].view(tokens, layer.num_heads, layer.head_dim)
        k = qkv[:, layer.q_size:layer.q_size + layer.kv_size].view(tokens, layer.num_kv_heads, layer.head_dim)
        v = qkv[:, layer.q_size + layer.kv_size:].view(tokens, layer.num_kv_heads, layer.head_dim)
        return q, k, v

    def _torch_layers(self, hidden, cos, sin, ctx) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._split(layer, layer.qkv(_rms_norm(layer.input_norm, hidden)))
            hidden = residual + self._attend(index, layer, _rotate(q, cos, sin), _rotate(k, cos, sin), v, ctx)
            residual = hidden
            gate_up = layer.gate_up(_rms_norm(layer.post_norm, hidden))
            x = layer.act(gate_up[:, :layer.intermediate]) * gate_up[:, layer.intermediate:]
            hidden = residual + layer.down(x)
        return _rms_norm(self.model.norm, hidden)

    def _fused_layers(self, residual, cos, sin, ctx) -> torch.Tensor:
        # kernels/cpu/fused_ops.cpp: each residual add is done in place together with the next norm
        fused = self.fused
        decode = _CpuDecode(ctx, residual.shape[0]) if ctx.max_query_len == 1 else None
        x = fused.add_rms_norm(residual, None, self.layers[0].input_norm.weight, self.layers[0].input_norm.variance_epsilon)
        for index, layer in enumerate(self.layers):
            q, k, v = self._split(layer, layer.qkv(x))
            q, k = fused.rotary(q, k, cos, sin)
            if decode is not None:
                attended = decode.attend(fused, index, layer, q, k, v, ctx)
            else:
                attended = self._attend(index, layer, q, k, v, ctx)
            x = fused.add_rms_norm(residual, attended, layer.post_norm.weight, layer.post_norm.variance_epsilon)
            gate_up = layer.gate_up(x)
            if gate_up.shape[0] <= FUSED_SILU_MAX_ROWS:
                down = layer.down(fused.silu_mul(gate_up))
            else:   # torch's vectorized exp beats the kernel's scalar one on prompt-sized steps
                down = layer.down(layer.act(gate_up[:, :layer.intermediate]) * gate_up[:, layer.intermediate:])
            norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.model.norm
            x = fused.add_rms_norm(residual, down, norm.weight, norm.variance_epsilon)
        return x


class _CpuDecode:
    """A decode-only step's inputs to the CPU attention kernels, made once per step: the generic path
    (ops/attention.py) rebuilds them in every layer, a dozen small torch operations each time."""

    def __init__(self, ctx, num_tokens: int):
        index = torch.arange(num_tokens, dtype=torch.int64)
        self.rows = torch.stack([index, index], dim=1).contiguous()   # token t is sequence t's query
        self.tables = ctx.block_tables.to(torch.int32).contiguous()
        self.seq_lens = ctx.seq_lens.to(torch.int32).contiguous()
        self.slots = ctx.slot_mapping.to(torch.int64).contiguous()

    def attend(self, kernel, index: int, layer: _Layer, q, k, v, ctx) -> torch.Tensor:
        cache = ctx.kv_pool[index]
        kernel.write_kv(k, v, cache[0], cache[1], self.slots)
        out = torch.empty_like(q)
        kernel.paged_decode(out, q, cache[0], cache[1], self.tables, self.seq_lens, self.rows,
                            float(layer.scaling), 0, 0.0)
        return layer.o(out.view(q.shape[0], layer.q_size))


def build(model) -> tuple[LlamaForward | None, str | None]:
    """(the lean forward, None) for a model that qualifies, else (None, why not)."""
    why = unsupported_reason(model)
    return (None, why) if why else (LlamaForward(model), None)
