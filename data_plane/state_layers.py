"""State layers on the state pool: the layers that keep a per-sequence state, run on pagedserve's
flattened batch of many sequences (data_plane/state_pool.py holds their states).

transformers runs such a layer on one row per sequence, with the state in its cache object. Our step
is one row of every scheduled sequence's tokens one after the other, so the layer's forward is
replaced, while a step runs, by one that splits the row by sequence, starts each from its slot's
state (or zeros at position 0) and writes the state after its last token back. Outside a step (the
start-time probe, transformers' own `generate`) the layer runs its own forward, unchanged.

Served: LFM2's short convolution (`Lfm2ShortConv`). Its state is the last kernel - 1 inputs of the
causal depthwise convolution; the output of a chunk of tokens is the convolution, without padding,
of the state followed by the chunk, which is what transformers computes for a whole prompt (zeros
padded in front) and for one decoded token (its cache's window followed by the token). A prompt
prefilled in chunks therefore gives the same numbers as one prefilled at once.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from data_plane import attention

_INSTALLED = "_pagedserve_state_layer"


def _short_conv_shape(module) -> tuple[int, ...]:
    return module.conv.weight.shape[0], module.conv.weight.shape[-1] - 1   # channels, kernel - 1


def _short_conv_forward(module, step, hidden_states, **kwargs):
    """LFM2's gated short convolution over a step's flattened rows [1, tokens, hidden]."""
    bcx = module.in_proj(hidden_states).transpose(-1, -2)    # [1, 3 * hidden, tokens]
    b, c, x = bcx.chunk(3, dim=-2)
    bx = (b * x)[0]                                          # [hidden, tokens]
    weight, bias = module.conv.weight, module.conv.bias      # [hidden, 1, kernel]
    channels, width = _short_conv_shape(module)
    states = step.pool.layer(module.layer_idx)               # [slots, hidden, kernel - 1]
    if step.decode_only:   # one token each: every sequence's window in one convolution
        windows = torch.cat([states.index_select(0, step.slots), bx.t()[:, :, None]], dim=-1)
        out = F.conv1d(windows, weight, bias, groups=channels)[:, :, 0].t()     # [hidden, seqs]
        states.index_copy_(0, step.slots, windows[:, :, 1:])
    else:
        out = torch.empty_like(bx)
        for start, end, slot, fresh in step.seqs:
            before = bx.new_zeros(channels, width) if fresh else states[slot]
            window = torch.cat([before, bx[:, start:end]], dim=-1)
            out[:, start:end] = F.conv1d(window[None], weight, bias, groups=channels)[0]
            states[slot] = window[:, -width:]
    y = (c[0] * out).t().contiguous()[None]                  # [1, tokens, hidden]
    return module.out_proj(y)


# state layer class -> (the shape of one sequence's state, the forward on the state pool)
LAYERS = {"Lfm2ShortConv": (_short_conv_shape, _short_conv_forward)}


def _dispatch(module, own, paged, *args, **kwargs):
    ctx = attention.current()
    if ctx is not None and ctx.state is not None:
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        return paged(module, ctx.state, hidden)
    return own(*args, **kwargs)


def find(model) -> dict[int, tuple]:
    """layer index -> the shape of one sequence's state, for every state layer we serve."""
    shapes = {}
    for module in model.modules():
        entry = LAYERS.get(type(module).__name__)
        if entry is not None:
            shapes[module.layer_idx] = tuple(entry[0](module))
    return shapes


def install(model) -> None:
    """Gives every served state layer of `model` the forward above, used while a step runs (once per model)."""
    for module in model.modules():
        entry = LAYERS.get(type(module).__name__)
        if entry is not None and not module.__dict__.get(_INSTALLED):
            module.forward = functools.partial(_dispatch, module, module.forward, entry[1])
            module.__dict__[_INSTALLED] = True
