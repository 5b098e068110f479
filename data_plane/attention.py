"""pagedserve's attention, registered with transformers so that its model classes run on the paged cache.

The model runner installs one StepContext per forward pass (`use_step_context`); every
attention layer reads the step's metadata from it instead of having it threaded through
the model's call chain. transformers calls `paged_attention_forward` with query, key and
value after rotary embedding, shaped [1, heads, tokens, head_dim] for our flattened batch,
plus the layer's own `sliding_window` (keys within that many positions, the query's own
included), `softcap` (Gemma 2's attention logit soft-cap) and `s_aux` (GPT-OSS's attention sinks, one
logit per query head) when the model has them. A layer of kind "chunked_attention" (Llama 4) attends
within chunks of the config's `attention_chunk_size`, which transformers puts in its mask, not in the
call: `layer_chunk` reads it from the config. Llama 4's NoPE layers scale each query by a factor of its
position (`attn_temperature_tuning`), which transformers takes from its cache's length; on our flattened
batch it would be wrong, so `prepare` hands that scaling to this function, which has every token's position.

`record_calls` replaces the paged path by a recorder for one forward pass: data_plane/model_support.py
uses it at start to see how a model calls attention, before serving anything.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ops.attention import Backend, KernelRows, paged_attention, write_kv

if TYPE_CHECKING:
    from data_plane.state_pool import StateStep
    from ops.linear import OwnCalls

ATTENTION_NAME = "pagedserve"


@dataclass
class GroupStep:
    """A layer group's part of a step (data_plane/kv_pool.py): its K/V slots, block tables and kernel rows."""
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    kernel_rows: KernelRows | None


@dataclass
class StepContext:
    kv_pool: torch.Tensor          # [attention layers, 2, blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor     # [tokens] int64: where each new token's K/V goes
    block_tables: torch.Tensor     # [seqs, max_blocks] int32
    seq_lens: torch.Tensor         # [seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    max_query_len: int
    # CPU: ops.attention.kernel_rows(...), the kernel's rows made once per step for every layer
    kernel_rows: KernelRows | None = None
    # the ops' implementation, chosen by the runner at start (None: each call chooses, outside a runner)
    backend: Backend | None = None
    # bool [tokens]: the tokens that transformers computes in a call of one row (generated tokens, prompts of
    # one token), whose bfloat16 products sum in other chunks (ops/linear.RoutedLinear.route); None: none
    one_row: torch.Tensor | None = None
    # the rows that transformers computes in a bfloat16 call of more rows, the prompts longer than
    # ops/linear.TILE_CALL_ROWS (a prompt's chunk at its place in the whole prompt's call), as ops/linear.OwnCalls;
    # AMX tile products give them oneDNN's order for that call (ops/linear.RoutedLinear.route). None: none
    own_calls: OwnCalls | None = None
    # int64 [rows]: the tokens whose last hidden state the step reads (sampled rows), in order; the forward
    # returns only theirs, and may skip the rest's last layer past its attention. None: every token's
    keep_rows: torch.Tensor | None = None
    # the state layers' part of the step (data_plane/state_pool.py), for a model that has them
    state: "StateStep | None" = None
    # model layer index -> its slab of kv_pool, for a model with state layers (which have no slab:
    # data_plane/kv_pool.py); None: every layer attends and its slab is its index
    kv_slabs: dict[int, int] | None = None
    # with layer groups: model layer index -> its group, and each group's part of the step, which its layers
    # read instead of the three fields above (those are the first group's); None: one group
    kv_groups: dict[int, int] | None = None
    groups: list[GroupStep] | None = None
    _positions: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        """int64 [tokens]: each query token's position in its sequence (made on first use, once a step)."""
        if self._positions is None:
            starts = self.query_start_loc.long()
            q_lens = starts[1:] - starts[:-1]
            # token t of sequence s sits at seq_lens[s] - q_len[s] + (t - starts[s])
            offset = torch.repeat_interleave(self.seq_lens.long() - q_lens - starts[:-1], q_lens)
            self._positions = offset + torch.arange(offset.shape[0], device=offset.device)
        return self._positions


@dataclass
class AttentionCall:
    """What one attention layer passed to the interface (recorded by `record_calls`)."""
    layer_idx: int | None
    query_shape: tuple
    key_shape: tuple
    value_shape: tuple
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    sinks_shape: tuple | None    # s_aux, the layer's attention sinks
    alibi_shape: tuple | None    # ALiBi slopes (data_plane/own_attention.py passes them)
    chunk: int | None            # see layer_chunk
    tunes_temperature: bool      # its queries are scaled here by position (see prepare)
    other_kwargs: dict = field(default_factory=dict)   # every other keyword that is not None


_current: StepContext | None = None
_recording: list[AttentionCall] | None = None


@contextlib.contextmanager
def use_step_context(ctx: StepContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


@contextlib.contextmanager
def record_calls():
    """Attention calls made inside are recorded, not computed (they return zeros)."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


_CHUNK_ATTR = "_pagedserve_chunk"


def layer_chunk(module) -> int | None:
    """The attention chunk of the module's layer: the config's `attention_chunk_size` for a layer of kind
    "chunked_attention", else None (kept on the module after the first call)."""
    chunk = module.__dict__.get(_CHUNK_ATTR, 0)
    if chunk == 0:
        config = getattr(module, "config", None)
        types = getattr(config, "layer_types", None) or []
        idx = getattr(module, "layer_idx", None)
        chunked = isinstance(idx, int) and idx < len(types) and types[idx] == "chunked_attention"
        chunk = config.attention_chunk_size if chunked else None
        module.__dict__[_CHUNK_ATTR] = chunk
    return chunk


def current() -> StepContext | None:
    """The step under way, None outside one (data_plane/state_layers.py reads its state part)."""
    return _current


def active() -> bool:
    """Whether a forward pass on pagedserve's attention is under way: a step, or the start-time probe."""
    return _current is not None or _recording is not None


class _UnlessPaged:
    """Stands in for a Llama 4 attention module's `attn_temperature_tuning`: true, so that transformers
    scales the queries of its NoPE layers itself, except while the model runs on pagedserve's attention,
    which scales them from each token's position instead (`_temperature_scaled`)."""

    def __bool__(self) -> bool:
        return not active()


def prepare(model) -> None:
    """Readies a model's attention modules for this function (data_plane/model_support.py calls it before
    its probe); changes nothing that the model's own attention implementations compute."""
    for module in model.modules():
        if getattr(module, "attn_temperature_tuning", None) is True and hasattr(module, "floor_scale"):
            module.attn_temperature_tuning = _UnlessPaged()


def _tunes_temperature(module) -> bool:
    return isinstance(getattr(module, "attn_temperature_tuning", None), _UnlessPaged) and not module.use_rope


def _temperature_scaled(module, query, positions):
    """Llama 4's attention temperature tuning, as transformers computes it, from the tokens' own positions."""
    positions = positions.float()
    scales = torch.log1p(torch.floor((positions + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, s_aux=None, alibi=None, **kwargs):
    """transformers' attention interface; `alibi` (float32 slopes [heads]) is ours, for the layers of
    data_plane/own_attention.py."""
    if _recording is not None:
        return _record(module, query, key, value, scaling, sliding_window, softcap, s_aux, alibi, kwargs)
    ctx = _current
    assert ctx is not None, "pagedserve attention called outside a step context"
    if _tunes_temperature(module):
        query = _temperature_scaled(module, query, ctx.positions)
    assert query.shape[0] == 1, "pagedserve runs one flattened row of tokens"
    layer = ctx.kv_pool[module.layer_idx if ctx.kv_slabs is None else ctx.kv_slabs[module.layer_idx]]
    k_cache, v_cache = layer[0], layer[1]
    part = ctx if ctx.groups is None else ctx.groups[ctx.kv_groups[module.layer_idx]]
    q = query[0].transpose(0, 1)   # [tokens, heads, dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    v_dim = v.shape[-1]
    if v_dim < k.shape[-1]:
        # V heads narrower than K heads (multi-head latent attention): stored padded with zeros, which add
        # nothing to the weighted sum; the output's padding is cut off below
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - v_dim))
    write_kv(k, v, k_cache, v_cache, part.slot_mapping, backend=ctx.backend)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(q, k_cache, v_cache, part.block_tables, ctx.seq_lens, ctx.query_start_loc,
                          scale, ctx.max_query_len, sliding_window=sliding_window, softcap=softcap,
                          sinks=None if s_aux is None else s_aux.detach().float(), alibi=alibi,
                          chunk=layer_chunk(module),
                          kernel_rows=part.kernel_rows, backend=ctx.backend)
    return out[..., :v_dim].unsqueeze(0), None  # [1, tokens, heads, V's dim]


def _record(module, query, key, value, scaling, sliding_window, softcap, s_aux, alibi, kwargs):
    other = {k: v for k, v in kwargs.items() if v is not None}
    sinks = None if s_aux is None else tuple(s_aux.shape)
    slopes = None if alibi is None else tuple(alibi.shape)
    _recording.append(AttentionCall(getattr(module, "layer_idx", None), tuple(query.shape), tuple(key.shape),
                                    tuple(value.shape), scaling, sliding_window, softcap, sinks, slopes,
                                    layer_chunk(module), _tunes_temperature(module), other))
    batch, heads, tokens, _ = query.shape
    return query.new_zeros(batch, tokens, heads, value.shape[-1]), None


def _no_mask(*args, **kwargs):
    # Causality and sequence boundaries come from the step context, not from a dense mask.
    return None


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    from data_plane import own_attention
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    own_attention.register_classes()
    return ATTENTION_NAME
