"""Which transformers decoder models pagedserve can serve exactly; every other one is refused at start.

pagedserve computes attention itself, through transformers' attention interface (data_plane/attention.py).
A model is served only if everything it does in attention is something our ops do too; anything else
would be served wrong without a warning, so `check_model` refuses it with `UnsupportedModel`, naming the
architecture and the reason. Two sources of truth:

- the config, for features no op implements (ALiBi, multi-head latent attention, bidirectional
  attention, layer kinds other than full, sliding-window and chunked attention);
- one probe forward pass at start, with attention recorded instead of computed: every decoder layer
  must call the interface exactly once, with K and V of the pool's head size, with the window the
  config declares, with attention sinks (if any) of one logit per query head, and with no argument we
  do not implement. A model that computes attention in its own code (BLOOM) makes no call and is refused.
  A layer that keeps a per-sequence state instead (LFM2's short convolutions) makes no attention call: it
  is served when data_plane/state_layers.py has its forward on the state pool, and refused otherwise.

The same probe picks how logits are computed from the sampled rows' hidden states (`final_logits`).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from data_plane import attention, kv_pool, own_attention, state_layers
from shared.config import ConfigError

log = logging.getLogger("pagedserve.data_plane")

# layer kinds of config.layer_types that our ops compute
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# layer kinds that keep a per-sequence state instead of (or beside) a KV cache: Mamba and Mamba2 SSMs,
# gated delta-net linear attention (Qwen3-Next), short convolutions (LFM2), attention beside an SSM (Falcon-H1)
STATE_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid"}
# model type -> its state layer kinds that data_plane/state_layers.py serves on the state pool
# (transformers names every SSM layer kind "linear_attention", Mamba2 mixers included)
SERVED_STATE_LAYERS = {"lfm2": {"conv"}, "mamba2": {"linear_attention"}, "granitemoehybrid": {"linear_attention"},
                       "bamba": {"linear_attention"}, "falcon_h1": {"hybrid"}, "qwen3_next": {"linear_attention"},
                       "mamba": {"linear_attention"}, "jamba": {"linear_attention"}}
# keywords transformers passes to attention functions that do not change what attention computes
# (any keyword set to False is a feature turned off, such as Mixtral's output_router_logits)
HARMLESS_KWARGS = {"position_ids", "cache_position", "use_cache", "output_attentions"}
_CACHE_ATTR = "_pagedserve_support"


class UnsupportedModel(ConfigError):
    """A model pagedserve cannot serve token-identically to transformers; raised at start."""

    def __init__(self, architecture: str, reasons: list[str]):
        self.architecture, self.reasons = architecture, reasons
        super().__init__(f"{architecture} is not supported by pagedserve: " + "; ".join(reasons))


@dataclass
class Support:
    """What the probe found that serving needs: per-layer windows and chunks (which blocks may be freed),
    and the logits function to use (the output embeddings, or the model's own head where it adds a
    soft-cap or scaling). Each layer's soft-cap reaches the attention in the layer's own call."""
    layer_windows: list[int | None]
    final_logits: Callable[[torch.Tensor], torch.Tensor]
    layer_chunks: list[int | None] = field(default_factory=list)
    # layer index -> the shape of one sequence's state, for the layers that keep one (state pool)
    state_shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def layer_reaches(self) -> list[int | None]:
        """Per layer, how far back its queries read: its window, or its chunk C (a query at p reads from the
        start of its chunk, which is after p - C); None: the whole context (or a state layer)."""
        chunks = self.layer_chunks or [None] * len(self.layer_windows)
        return [w or c for w, c in zip(self.layer_windows, chunks)]

    @property
    def freeable_window(self) -> int:
        """The widest reach when every layer's is bounded (Mistral), else 0 (Gemma 2/3 and Llama 4 have
        global layers): a block wholly before that many positions of a sequence's next query is read by
        no layer again. Where only some layers' is, the pool's layer groups free blocks per group
        (data_plane/kv_pool.py)."""
        reach = self.layer_reaches
        if not reach or any(r is None for r in reach):
            return 0
        return max(reach)


def architecture(config, model=None) -> str:
    """The class name checkpoints record (LlamaForCausalLM), else the model's own class name."""
    names = getattr(config, "architectures", None) or []
    if names:
        return names[0]
    return type(model).__name__ if model is not None else type(config).__name__.removesuffix("Config")


def head_dim(config) -> int:
    """The K/V head size the KV pool is allocated with (data_plane/model_runner.py uses the same): with
    multi-head latent attention (DeepSeek-V2/V3) the K head size, query and key, nope and rotary parts
    together; V heads are narrower and are stored padded to it (data_plane/attention.py)."""
    if not attention_layers(config):
        return 1   # no layer attends (Mamba2): see kv_heads
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_head_dim", None):
        return config.qk_head_dim
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    """The KV heads of each layer of the pool; 1 for a model no layer of which attends (Mamba2), whose pool
    has no layer: its blocks only stand for the tokens the control plane counts."""
    if not attention_layers(config):
        return 1
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def config_windows(config) -> list[int | None]:
    """Sliding window of each layer as transformers' masks apply it: with `layer_types`, the layers of
    kind "sliding_attention" (Gemma 2/3, Qwen2/3); without, every layer when `sliding_window` is set
    (Mistral, Mixtral, Phi-3). A window W lets a query see the W positions ending at its own."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * config.num_hidden_layers


def config_reasons(config) -> list[str]:
    """Features of the config that no pagedserve op implements."""
    reasons = []
    attn_config = getattr(config, "attn_config", None)
    alibi = config.model_type == "bloom" or getattr(config, "alibi", False) or getattr(attn_config, "alibi", False)
    if alibi and config.model_type == "falcon":
        reasons.append("Falcon's ALiBi is not served: transformers' eager attention adds the bias twice, its "
                       "SDPA attention once, so there is no one result to be identical to")
    elif alibi and config.model_type not in own_attention.ALIBI_MODEL_TYPES:
        reasons.append(f"ALiBi position bias is served for {sorted(own_attention.ALIBI_MODEL_TYPES)} only, "
                       f"not {config.model_type}")
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        reasons.append("slow_but_exact with pretraining_tp > 1 splits the output projection in a way "
                       "pagedserve does not reproduce")
    v_dim, qk_dim = getattr(config, "v_head_dim", None), getattr(config, "qk_head_dim", None)
    if v_dim and qk_dim and v_dim > qk_dim:
        reasons.append(f"V head size {v_dim} is wider than K head size {qk_dim}; the KV pool holds V heads "
                       "no wider than K heads")
    types = getattr(config, "layer_types", None) or []
    state = sorted(set(types) & STATE_LAYER_TYPES - SERVED_STATE_LAYERS.get(config.model_type, set()))
    if state:
        reasons.append(f"its layers of kinds {state} keep a per-sequence state (SSM, linear attention or "
                       "convolution) that pagedserve's state pool does not compute yet (it serves "
                       f"{', '.join(f'{t} layers of {m}' for m, ts in SERVED_STATE_LAYERS.items() for t in sorted(ts))})")
    unknown = sorted(set(types) - SUPPORTED_LAYER_TYPES - STATE_LAYER_TYPES)
    if unknown:
        reasons.append(f"layer kinds {unknown} are not implemented (only {sorted(SUPPORTED_LAYER_TYPES)})")
    if getattr(config, "use_bidirectional_attention", False):
        reasons.append("bidirectional attention is not implemented (decoding is causal)")
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models are not served")
    return reasons


def check_config(config) -> None:
    reasons = config_reasons(config)
    if reasons:
        raise UnsupportedModel(architecture(config), reasons)


def _probe_ids(model) -> torch.Tensor:
    vocab = model.get_output_embeddings().weight.shape[0]
    return (torch.arange(5, device=model.device) * 7 + 3).remainder(vocab)[None]


def attention_layers(config) -> list[int]:
    """The layers that attend: every one but those of a state kind (LFM2's convolutions, Mamba2 mixers),
    except "hybrid" layers (Falcon-H1), which do both."""
    types = getattr(config, "layer_types", None)
    return [i for i in range(config.num_hidden_layers) if not types or types[i] not in STATE_LAYER_TYPES - {"hybrid"}]


def pool_layout(model) -> kv_pool.Layout:
    """The KV pool's slabs and layer groups for a model that check_model accepted: its attention layers,
    grouped by how far back each reads."""
    support = check_model(model)
    attending = attention_layers(model.config)
    return kv_pool.layout({layer: support.layer_reaches[layer] for layer in attending},
                          model.config.num_hidden_layers)


def state_layers_of(config) -> list[int]:
    """The layers that keep a per-sequence state."""
    types = getattr(config, "layer_types", None) or []
    return [i for i, kind in enumerate(types) if kind in STATE_LAYER_TYPES]


def _call_reasons(config, calls: list[attention.AttentionCall]) -> list[str]:
    layers = config.num_hidden_layers
    expected = attention_layers(config)
    if not expected:
        return [] if not calls else [f"its layers of state kinds made attention calls (layers "
                                     f"{[c.layer_idx for c in calls]})"]
    if not calls:
        return ["its attention does not go through transformers' attention interface (it computes "
                "attention in its own code)"]
    reasons = []
    seen = [c.layer_idx for c in calls]
    if sorted(i for i in seen if i is not None) != expected or len(seen) != len(expected):
        reasons.append(f"its {layers} layers made attention calls for layers {seen}; pagedserve needs one "
                       f"call per attention layer ({expected}), each with its layer index")
    dim, heads = head_dim(config), kv_heads(config)
    windows = config_windows(config)
    for c in calls:
        if c.key_shape[-1] < c.value_shape[-1]:
            reasons.append(f"V head size {c.value_shape[-1]} is wider than K head size {c.key_shape[-1]}; "
                           "the KV pool holds V heads no wider than K heads")
        elif c.key_shape[-1] != dim or c.query_shape[-1] != dim:
            reasons.append(f"attention heads of size {c.key_shape[-1]} do not match the config's head size {dim}")
        if c.key_shape[1] != heads or c.query_shape[1] % c.key_shape[1]:
            reasons.append(f"{c.key_shape[1]} KV heads for {c.query_shape[1]} query heads (config: {heads})")
        if isinstance(c.layer_idx, int) and 0 <= c.layer_idx < layers and c.sliding_window != windows[c.layer_idx]:
            reasons.append(f"layer {c.layer_idx} passes sliding window {c.sliding_window} but its config "
                           f"declares {windows[c.layer_idx]}")
        for what, shape in (("attention sinks", c.sinks_shape), ("ALiBi slopes", c.alibi_shape)):
            if shape is not None and shape != (c.query_shape[1],):
                reasons.append(f"its {what} have shape {shape}, not one per query head ({c.query_shape[1]})")
        if c.other_kwargs.get("is_causal", True) is not True:
            reasons.append("its attention is not causal (is_causal=False); pagedserve's is")
        unknown = sorted(k for k, v in c.other_kwargs.items()
                         if k not in HARMLESS_KWARGS and k != "is_causal" and v is not False)
        if unknown:
            reasons.append(f"its attention passes {unknown}, which pagedserve does not implement")
    return list(dict.fromkeys(reasons))   # one line per distinct reason, in order


class _GivenHidden(torch.nn.Module):
    """Stands in for the base model while the model's own head runs on hidden rows we already have."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast
        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


def own_head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of hidden rows [rows, hidden] through the causal-LM class's own forward (its final
    soft-cap, scaling, ...), with the base model swapped for the rows for the duration of the call."""
    prefix = model.base_model_prefix
    base = model._modules[prefix]
    model._modules[prefix] = _GivenHidden(hidden[None])
    try:
        dummy = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
        return model(input_ids=dummy, use_cache=False, logits_to_keep=0).logits[0]
    finally:
        model._modules[prefix] = base


def _choose_logits(model, hidden: torch.Tensor, own: torch.Tensor):
    """The cheapest logits path that reproduces the model's own forward on the probe, or None."""
    plain = model.get_output_embeddings()(hidden)
    try:
        head = own_head_logits(model, hidden)
    except Exception as exc:   # a head that calls parts of the base model itself (OPT calls its decoder)
        log.debug("own-head logits unavailable for %s: %s", type(model).__name__, exc)
        head = None
    if head is not None and torch.allclose(head, own, rtol=1e-5, atol=1e-5):
        if torch.equal(plain, head):   # the head adds nothing (no soft-cap, no scaling): skip its overhead
            return model.get_output_embeddings()
        return lambda rows: own_head_logits(model, rows)
    if torch.equal(plain, own) or (head is None and torch.allclose(plain, own, rtol=1e-5, atol=1e-5)):
        return model.get_output_embeddings()
    return None


@contextlib.contextmanager
def _paged_attention(model):
    previous = model.config._attn_implementation
    if previous != attention.ATTENTION_NAME:
        model.set_attn_implementation(attention.register())
    try:
        yield
    finally:
        if previous != attention.ATTENTION_NAME:
            model.set_attn_implementation(previous)


def _find_base_model(model) -> None:
    """Points `model.base_model` at the decoder when the class names a prefix it does not have
    (Llama4ForCausalLM names "language_model", its prefix inside the multimodal model, but holds the
    decoder as "model"): the runner and the probe run the base model on its own."""
    if model.base_model is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        model.base_model_prefix = "model"


@torch.inference_mode()
def check_model(model) -> Support:
    """Refuses (UnsupportedModel) a model pagedserve cannot serve exactly; returns what serving needs.

    The result is kept on the model, so load_model and the runner probe it once."""
    cached = model.__dict__.get(_CACHE_ATTR)
    if cached is not None:
        return cached
    config = model.config
    arch = architecture(config, model)
    reasons = config_reasons(config)
    if reasons:
        raise UnsupportedModel(arch, reasons)
    ids = _probe_ids(model)
    attention.prepare(model)
    own_attention.install(model)
    state_layers.install(model)
    _find_base_model(model)
    # probed on pagedserve's attention whatever the model was last set to (benchmarks switch it back
    # and forth); the base model as the runner calls it, then the whole model as generate does
    with _paged_attention(model), attention.record_calls() as calls:
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
    reasons = _call_reasons(config, calls)
    shapes = state_layers.find(model)
    stateful = state_layers_of(config)
    if sorted(shapes) != stateful:
        reasons.append(f"its state layers {stateful} are not the layers pagedserve computes on the state pool "
                       f"({sorted(shapes)})")
    if reasons:
        raise UnsupportedModel(arch, reasons)
    with _paged_attention(model), attention.record_calls():   # zeros from attention in both passes
        own = model(input_ids=ids, use_cache=False).logits[0]
    chosen = _choose_logits(model, hidden, own)
    if chosen is None:
        raise UnsupportedModel(arch, ["its final logits are computed in a way pagedserve does not reproduce"])
    by_layer = {c.layer_idx: c for c in calls}
    calls_of = [by_layer.get(i) for i in range(config.num_hidden_layers)]   # None: a state layer
    support = Support([c and c.sliding_window for c in calls_of], chosen, [c and c.chunk for c in calls_of], shapes)
    model.__dict__[_CACHE_ATTR] = support
    return support


def load_refusal(architecture_name: str, exc: BaseException) -> UnsupportedModel | None:
    """The refusal for a model whose construction failed because it has no place for our attention
    (Falcon and GPT-Neo look attention classes up in their own table: KeyError 'pagedserve')."""
    if isinstance(exc, KeyError) and exc.args == (attention.ATTENTION_NAME,):
        return UnsupportedModel(architecture_name, [
            "its attention does not go through transformers' attention interface (it picks its own "
            "attention classes)"])
    return None
