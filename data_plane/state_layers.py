"""State layers on the state pool: the layers that keep a per-sequence state, run on pagedserve's
flattened batch of many sequences (data_plane/state_pool.py holds their states).

transformers runs such a layer on one row per sequence, with the state in its cache object. Our step
is one row of every scheduled sequence's tokens one after the other, so the layer's forward is
replaced, while a step runs, by one that splits the row by sequence, starts each from its slot's
state (or zeros at position 0) and writes the state after its last token back. Outside a step (the
start-time probe, transformers' own `generate`) the layer runs its own forward, unchanged.

Served:
- LFM2's short convolution (`Lfm2ShortConv`): its state is the last kernel - 1 inputs of a causal
  depthwise convolution. The output of a run of tokens is the convolution, without padding, of the
  state followed by the run: what transformers computes for a whole prompt (zeros padded in front)
  and for one decoded token (its cache's window followed by the token).
- The Mamba2 mixer (`Mamba2Mixer`; Granite 4.0 hybrid's and Bamba's are the same code, Falcon-H1's adds
  multipliers and may gate by SiLU instead of its gated norm): the same kind
  of convolution (then SiLU) and an SSM state [heads, head size, state size], kept in float32 as
  transformers keeps it. A run of several tokens goes through the model's own chunked scan
  (`mamba2_chunk_scan`) from the slot's state, one token through its own recurrent update
  (`mamba2_selective_state_update`), as transformers' prefill and decode do. A prompt prefilled in
  chunks is scanned from the state at each chunk's start: the same sums as one scan over the whole
  prompt, regrouped at the chunk boundaries (equal up to float rounding).
- The Mamba mixer (`MambaMixer`; Jamba's adds norms): the same convolution and a float32 SSM state
  [inner size, state size]. A prompt's first run goes through the model's own scan from zeros; its scan
  takes no initial state, so a later run of several tokens (a chunk of a chunked prefill) goes token by
  token through the model's own recurrent update, the one transformers decodes with.
- Qwen3-Next's gated delta-net (`Qwen3NextGatedDeltaNet`): the same convolution (then SiLU) and a float32
  recurrent state [value heads, key head size, value head size], through the model's own chunked rule
  for a run of tokens and its recurrent rule for one, as transformers' prefill and decode do.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from data_plane import attention

_INSTALLED = "_pagedserve_state_layer"


def _conv_run(bx: torch.Tensor, conv, states: torch.Tensor, step, act=None) -> torch.Tensor:
    """The causal depthwise convolution `conv` over each sequence's run of columns of bx [channels,
    tokens], from its slot's window of the previous kernel - 1 inputs in `states` [slots, channels,
    kernel - 1], which it then updates; `act` applied to the output."""
    weight, bias = conv.weight, conv.bias                    # [channels, 1, kernel]
    channels, width = weight.shape[0], weight.shape[-1] - 1
    if step.decode_only:   # one token each: every sequence's window in one convolution
        windows = torch.cat([states.index_select(0, step.slots), bx.t()[:, :, None]], dim=-1)
        out = F.conv1d(windows, weight, bias, groups=channels)[:, :, 0].t()     # [channels, seqs]
        states.index_copy_(0, step.slots, windows[:, :, 1:])
    else:
        out = torch.empty_like(bx)
        for start, end, slot, fresh in step.seqs:
            before = bx.new_zeros(channels, width) if fresh else states[slot]
            window = torch.cat([before, bx[:, start:end]], dim=-1)
            out[:, start:end] = F.conv1d(window[None], weight, bias, groups=channels)[0]
            states[slot] = window[:, -width:]
    return out if act is None else act(out)


def _conv_part(conv) -> tuple[tuple[int, ...], None]:
    return (conv.weight.shape[0], conv.weight.shape[-1] - 1), None   # channels, kernel - 1; the model's dtype


# --- LFM2 ------------------------------------------------------------------------------------------------
def _short_conv_parts(module):
    return (_conv_part(module.conv),)


def _short_conv_forward(module, step, hidden_states):
    """LFM2's gated short convolution over a step's flattened rows [1, tokens, hidden]."""
    bcx = module.in_proj(hidden_states).transpose(-1, -2)    # [1, 3 * hidden, tokens]
    b, c, x = bcx.chunk(3, dim=-2)
    (states,) = step.pool.layer(module.layer_idx)
    out = _conv_run((b * x)[0], module.conv, states, step)
    y = (c[0] * out).t().contiguous()[None]                  # [1, tokens, hidden]
    return module.out_proj(y)


# --- Mamba2 ----------------------------------------------------------------------------------------------
def _mamba2_parts(module):
    ssm = (module.num_heads, module.head_dim, module.ssm_state_size), torch.float32
    return _conv_part(module.conv1d), ssm


def _mamba2_forward(module, step, hidden_states):
    """transformers' Mamba2 mixer (its torch path, no padding mask) over a step's flattened rows."""
    ops = sys.modules[type(module).__module__]   # the model file's own scan functions
    conv_states, ssm_states = step.pool.layer(module.layer_idx)
    mup = getattr(module, "mup_vector", None)    # Falcon-H1's multipliers
    if mup is not None:
        hidden_states = hidden_states * module.ssm_in_multiplier
    projected = module.in_proj(hidden_states)                 # [1, tokens, ...]
    if mup is not None:
        projected = projected * mup
    # Falcon-H1 without its gated norm gates the scan's output by SiLU(gate) (inside the recurrent update)
    normed = getattr(module, "mamba_rms_norm", True)
    a = -torch.exp(module.A_log.float())
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    xbc = _conv_run(xbc[0].t(), module.conv1d, conv_states, step, module.act).t()   # [tokens, conv_dim]
    groups, size, heads, head_dim = module.n_groups, module.ssm_state_size, module.num_heads, module.head_dim
    x, b, c = torch.split(xbc, [module.intermediate_size, groups * size, groups * size], dim=-1)
    # float32, as the scan returns it and transformers normalizes it
    out = torch.empty(x.shape[0], module.intermediate_size, dtype=torch.float32, device=x.device)
    if step.decode_only:
        out[:] = _mamba2_token(ops, module, ssm_states, step.slots, x, dt[0], a, b, c, None if normed else gate[0])
    else:
        for start, end, slot, fresh in step.seqs:
            n = end - start
            if n == 1 and not fresh:
                slots = torch.tensor([slot], device=x.device)
                out[start:end] = _mamba2_token(ops, module, ssm_states, slots, x[start:end], dt[0, start:end], a,
                                               b[start:end], c[start:end], None if normed else gate[0, start:end])
                continue
            scanned, final = ops.mamba2_chunk_scan(
                x[None, start:end].reshape(1, n, heads, head_dim), dt[:, start:end], a,
                b[None, start:end].reshape(1, n, groups, size), c[None, start:end].reshape(1, n, groups, size),
                chunk_size=module.chunk_size, D=module.D, z=None, return_final_states=True,
                dt_bias=module.dt_bias, dt_softplus=True, initial_states=None if fresh else ssm_states[slot][None],
                dt_limit=module.time_step_limit)
            ssm_states[slot] = final[0]
            scanned = scanned.reshape(n, -1)
            out[start:end] = scanned if normed else scanned * F.silu(gate[0, start:end])
    y = module.norm(out[None], gate) if normed else out[None]
    return module.out_proj(y.to(hidden_states.dtype))


def _mamba2_token(ops, module, ssm_states, slots, x, dt, a, b, c, z=None):
    """One token each of len(slots) sequences through the recurrent update, as transformers decodes."""
    n, heads, head_dim, size = x.shape[0], module.num_heads, module.head_dim, module.ssm_state_size
    state = ssm_states.index_select(0, slots)
    out = ops.mamba2_selective_state_update(
        state, x.view(n, heads, head_dim), dt[:, :, None].expand(-1, -1, head_dim),
        a[:, None, None].expand(-1, head_dim, size), b.view(n, module.n_groups, size),
        c.view(n, module.n_groups, size), module.D[:, None].expand(-1, head_dim),
        z=None if z is None else z.view(n, heads, head_dim),
        dt_bias=module.dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
    ssm_states.index_copy_(0, slots, state)
    return out.view(n, -1)


# --- Mamba (1) ----------------------------------------------------------------------------------------------
def _mamba_parts(module):
    return _conv_part(module.conv1d), ((module.intermediate_size, module.ssm_state_size), torch.float32)


def _mamba_forward(module, step, hidden_states):
    """transformers' Mamba mixer (Jamba's adds norms of dt, B and C) over a step's flattened rows."""
    ops = sys.modules[type(module).__module__]
    conv_states, ssm_states = step.pool.layer(module.layer_idx)
    xs, gate = module.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)     # [1, inner, tokens] each
    xs = _conv_run(xs[0], module.conv1d, conv_states, step, module.act)[None]
    a = -torch.exp(module.A_log.float())
    size = module.ssm_state_size
    dt, b, c = torch.split(module.x_proj(xs.transpose(1, 2)), [module.time_step_rank, size, size], dim=-1)
    if hasattr(module, "dt_layernorm"):
        dt, b, c = module.dt_layernorm(dt), module.b_layernorm(b), module.c_layernorm(c)
    if hasattr(module.config, "_is_quantized"):
        dt = (module.dt_proj(dt) - module.dt_proj.bias).transpose(1, 2)
    else:
        dt = module.dt_proj.weight @ dt.transpose(1, 2)                           # [1, inner, tokens]
    bias = module.dt_proj.bias.float() if module.dt_proj.bias is not None else None

    def token(slots, t):   # one token of each sequence in `slots`, from column t on, as transformers decodes
        n = slots.shape[0]
        state = ssm_states.index_select(0, slots)
        out = ops.mamba_selective_state_update(state, xs[0, :, t:t + n].t(), dt[0, :, t:t + n].t(), a, b[0, t:t + n],
                                               c[0, t:t + n], module.D, z=gate[0, :, t:t + n].t(), dt_bias=bias,
                                               dt_softplus=True)
        ssm_states.index_copy_(0, slots, state)
        return out.t()                                                            # [inner, n]

    if step.decode_only:
        out = token(step.slots, 0)
    else:
        out = torch.empty_like(xs[0])
        for start, end, slot, fresh in step.seqs:
            if fresh:   # a prompt's first run: the model's own scan from zeros, as transformers prefills
                scanned, final = ops.mamba_selective_scan(
                    xs[:, :, start:end], dt[:, :, start:end], a, b[:, start:end].transpose(1, 2),
                    c[:, start:end].transpose(1, 2), D=module.D.float(), z=gate[:, :, start:end], delta_bias=bias,
                    delta_softplus=True, return_last_state=True, use_mambapy=module.use_mambapy,
                    use_associative_scan=module.use_associative_scan)
                ssm_states[slot] = final[0]
                out[:, start:end] = scanned[0]
            else:       # its scan takes no initial state: the same recurrence, token by token from the slot's
                slots = torch.tensor([slot], device=xs.device)
                for t in range(start, end):
                    out[:, t:t + 1] = token(slots, t)
    return module.out_proj(out.t()[None].to(hidden_states.dtype))


# --- gated delta-net (Qwen3-Next's linear attention) --------------------------------------------------------
def _delta_net_parts(module):
    recurrent = (module.num_v_heads, module.head_k_dim, module.head_v_dim), torch.float32
    return _conv_part(module.conv1d), recurrent


def _delta_net_forward(module, step, hidden_states):
    """transformers' gated delta-net (its torch path) over a step's flattened rows."""
    from transformers.activations import ACT2FN
    ops = sys.modules[type(module).__module__]
    conv_states, recurrent_states = step.pool.layer(module.layer_idx)
    query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                                     module.in_proj_ba(hidden_states))
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1)
    mixed = _conv_run(mixed[0].t(), module.conv1d, conv_states, step, ACT2FN[module.activation]).t()
    query, key, value = torch.split(mixed[None], [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, query.shape[1], -1, module.head_k_dim)
    key = key.reshape(1, key.shape[1], -1, module.head_k_dim)
    value = value.reshape(1, value.shape[1], -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    if step.decode_only:   # one token each: the recurrent rule over the batch of sequences
        state = recurrent_states.index_select(0, step.slots)
        out, final = ops.torch_recurrent_gated_delta_rule(
            *(t[0][:, None] for t in (query, key, value)), g=g[0][:, None], beta=beta[0][:, None],
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        recurrent_states.index_copy_(0, step.slots, final)
        out = out[:, 0][None]                                   # [1, tokens, heads, v head size]
    else:
        out = torch.empty_like(value)
        for start, end, slot, fresh in step.seqs:
            run = ops.torch_recurrent_gated_delta_rule if end - start == 1 and not fresh else \
                ops.torch_chunk_gated_delta_rule
            piece, final = run(query[:, start:end], key[:, start:end], value[:, start:end], g=g[:, start:end],
                               beta=beta[:, start:end], initial_state=None if fresh else recurrent_states[slot][None],
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
            recurrent_states[slot] = final[0]
            out[:, start:end] = piece
    normed = module.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return module.out_proj(normed.reshape(1, out.shape[1], -1))


# state layer class -> ((shape, dtype) of each part of one sequence's state, the forward on the state pool)
LAYERS = {"Lfm2ShortConv": (_short_conv_parts, _short_conv_forward),
          "Mamba2Mixer": (_mamba2_parts, _mamba2_forward),
          "GraniteMoeHybridMambaLayer": (_mamba2_parts, _mamba2_forward),
          "BambaMixer": (_mamba2_parts, _mamba2_forward),
          "FalconH1Mixer": (_mamba2_parts, _mamba2_forward),
          "Qwen3NextGatedDeltaNet": (_delta_net_parts, _delta_net_forward),
          "MambaMixer": (_mamba_parts, _mamba_forward),
          "JambaMambaMixer": (_mamba_parts, _mamba_forward)}


def _dispatch(module, own, paged, *args, **kwargs):
    ctx = attention.current()
    if ctx is not None and ctx.state is not None:
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        return paged(module, ctx.state, hidden)
    return own(*args, **kwargs)


def find(model) -> dict[int, tuple]:
    """layer index -> the (shape, dtype) of each part of one sequence's state, for every state layer we serve."""
    parts = {}
    for module in model.modules():
        entry = LAYERS.get(type(module).__name__)
        if entry is not None:
            parts[module.layer_idx] = tuple(entry[0](module))
    return parts


def install(model) -> None:
    """Gives every served state layer of `model` the forward above, used while a step runs (once per model)."""
    for module in model.modules():
        entry = LAYERS.get(type(module).__name__)
        if entry is not None and not module.__dict__.get(_INSTALLED):
            module.forward = functools.partial(_dispatch, module, module.forward, entry[1])
            module.__dict__[_INSTALLED] = True
