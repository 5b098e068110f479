"""A lean forward pass for Llama-shaped models on the CPU in float32 or bfloat16 (SmolLM2, the default
model).

transformers' forward spends about a quarter of a small decode step outside the matrix products
(module calls, hooks, views and transposes of [batch, heads, tokens, dim] tensors). This forward
runs the same arithmetic on the flattened [tokens, ...] rows of a step with fewer calls:

- Q, K and V come from one product with the three weights stacked, and gate and up from another.
  The model's own q/k/v/gate/up weights become views into the stacked copies, so no memory is
  added and transformers' forward (model_support's probe) still runs on the same numbers;
- RMSNorm, rotary embedding, SiLU and the residual adds are transformers' own operations in the
  same order and the same types (in bfloat16: the norm in float32, rounded where transformers rounds;
  the rotary cos/sin come from the model's own rotary module), so the numbers match transformers'
  forward up to the products' summation order, as with the routed linear layers (in bfloat16 every
  route gives F.linear's very bits where the CPU has AVX512-BF16, and the norm sums in torch's order:
  then the attention's products are what differs, ops/attention.py);
- attention is the data plane's paged attention (ops/attention.py), called directly.

Only models whose every layer is the plain Llama block qualify (`build` says why not otherwise);
the others keep transformers' forward with the paged attention registered as its attention.
"""
from __future__ import annotations

import sys

import torch

from ops import cpu_kernels
from ops import linear as linear_ops
from ops import quantized
from ops import attention as attention_ops
from ops.attention import paged_attention, write_kv


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
        return f"{weight.dtype} on {weight.device.type} (this forward is for float32 or bfloat16 on the CPU)"
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
    def __init__(self, layer, kernel, packed: bool, codes: bool | dict):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.num_heads = attn.config.num_attention_heads
        self.num_kv_heads = attn.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        def route(modules):
            # a dict holds the codes found per module before the model was narrowed to bfloat16
            given = quantized.Codes.cat([codes.get(m) for m in modules]) if isinstance(codes, dict) else codes
            weight = _stack(modules) if len(modules) > 1 else modules[0].weight
            return linear_ops.RoutedLinear(weight, None, kernel, packed, codes=given,
                                           parts=tuple(m.weight.shape[0] for m in modules))
        self.qkv = route([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = route([attn.o_proj])
        self.gate_up = route([mlp.gate_proj, mlp.up_proj])
        self.down = route([mlp.down_proj])


def _plain_silu(model) -> bool:
    return type(model.model.layers[0].mlp.act_fn).__name__ == "SiLUActivation"


class _TorchOps:
    """The elementwise parts of a layer in torch's operations, transformers' arithmetic in order."""

    def __init__(self, act):
        self.act = act

    @staticmethod
    def add_rms_norm(residual, x, weight, eps):
        if x is not None:
            residual.add_(x)
        wide = residual.float()   # the residual itself in float32
        variance = wide.pow(2).mean(-1, keepdim=True)
        return weight * (wide * torch.rsqrt(variance + eps)).to(residual.dtype)

    @staticmethod
    def rotary(q, k, cos, sin):
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_mul(self, gate_up):
        half = gate_up.shape[1] // 2
        return self.act(gate_up[:, :half]) * gate_up[:, half:]


class _KernelOps(_TorchOps):
    """The same parts in pagedserve_kernels/cpu/fused_ops.cpp, one pass each, in float32 or bfloat16 (rounded where
    transformers' bfloat16 operations round)."""

    def __init__(self, act, kernel):
        super().__init__(act)
        self.add_rms_norm, self.rotary, self.silu_mul = kernel.add_rms_norm, kernel.rotary, kernel.silu_mul


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class LlamaForward:
    """hidden states [tokens, hidden] of the model's last norm for one step's flattened tokens."""

    def __init__(self, model, fused: bool = True, codes: bool | dict = True):
        self.model = model.model
        # built for float32 and bfloat16 alike (unsupported_reason checked the type); the products
        # of a bfloat16 model take oneDNN's GEMM whatever the kernel module holds
        kernel = cpu_kernels.load()
        self.layers = [_Layer(layer, kernel, True, codes) for layer in self.model.layers]
        act = self.model.layers[0].mlp.act_fn
        # the fused norm/rotary/SiLU kernels when built, else torch's operations
        use_kernel = kernel is not None and _plain_silu(model) and fused
        self.ops = _KernelOps(act, kernel) if use_kernel else _TorchOps(act)
        # attention's route, chosen once: the C++ kernel called directly (its own checks still run), or
        # the dispatching ops (Triton when forced, the torch reference without the kernel)
        weight = model.get_output_embeddings().weight
        backend = attention_ops.choose(weight.device, weight.dtype)
        self.attention_kernel = backend.kernel
        self.sdpa_lanes = backend.sdpa_lanes
        self.mkl_order = backend.mkl_order
        self.kernel = kernel
        self.fused_attention = self.attention_kernel is not None and use_kernel
        # each norm's (weight, eps): norms[i] before layer i (norms[-1] the model's last), post_norms[i] after
        # layer i's attention
        self.norms = [(layer.input_norm.weight, layer.input_norm.variance_epsilon) for layer in self.layers]
        self.norms.append((self.model.norm.weight, self.model.norm.variance_epsilon))
        self.post_norms = [(layer.post_norm.weight, layer.post_norm.variance_epsilon) for layer in self.layers]
        self._route_cap = max(lin.rows_cap for lin in self.linears())
        # whether a step's long prompts (StepContext.own_calls) change a product's route: the AMX tiles' only
        self._own_calls = any(lin.tiles is not None for lin in self.linears())
        self._route_cache: dict[int, list[tuple]] = {}
        self._pool, self._pool_views = None, []
        self.coded_layers, self.coded_rows = self._coded_layers()
        # whether the last layer's products past its attention may leave rows out (__call__'s keep_rows)
        last = self.layers[-1]
        self._last_rows_apart = all(lin.rows_apart for lin in (last.o, last.gate_up, last.down))
        self.rotary = _Rotary(self.model.rotary_emb, getattr(model.config, "max_position_embeddings", 0) or 0,
                              weight.dtype)

    def _coded_layers(self):
        """The kernel's CodedLayers (pagedserve_kernels/cpu/coded_layers.cpp), which runs every layer in one
        call with the kernels this loop calls one by one, where every product reads GGUF codes (a float32
        model's at every row count, a bfloat16 model's up to a few rows, and above those its bfloat16 kernel
        where that is each product's route: RoutedLinear.wide_route) and the norms, rotary and attention are
        the kernel's; with the most rows it takes. (None, 0) where there is none."""
        if not self.fused_attention or not hasattr(self.kernel, "CodedLayers"):
            return None, 0
        shape = {(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling) for layer in self.layers}
        if len(shape) != 1:
            return None, 0
        # every product's codes route of one row; a product reads its codes (always with the same kernel
        # and tensors) from one row up to some count, so the loop serves the counts where all of them do
        linears = self.linears()
        routes = [lin.codes_route(1) for lin in linears]
        if any(route is None for route in routes):
            return None, 0
        codes_rows = []
        for lin in linears:
            rows = 1
            while rows < self._route_cap and lin.codes_route(rows + 1) is not None:
                rows += 1
            # (the routes of every count from the cap on are the cap's)
            codes_rows.append(sys.maxsize if rows == self._route_cap else rows)
        wides = [lin.wide_route() if rows < sys.maxsize else None for lin, rows in zip(linears, codes_rows)]
        none = torch.empty(0)
        tensors, kinds = [], []
        for index, layer in enumerate(self.layers):
            for (name, parts), rows, wide in zip(routes[4 * index:4 * index + 4], codes_rows[4 * index:4 * index + 4],
                                                 wides[4 * index:4 * index + 4]):
                tensors += [part if part is not None else none for part in parts] + [none] * (3 - len(parts))
                tensors.append(wide[1] if wide is not None and wide[1] is not None else none)
                kinds += [linear_ops.CODES_KERNELS.index(name), rows,
                          linear_ops.WIDE_KERNELS.index(wide[0]) + 1 if wide is not None else 0]
            tensors += [self.post_norms[index][0], self.norms[index + 1][0]]
        layers = self.kernel.CodedLayers(tensors, kinds, [eps for _, eps in self.post_norms],
                                         [eps for _, eps in self.norms[1:]], *shape.pop())
        served = min(sys.maxsize if wide is not None else rows for rows, wide in zip(codes_rows, wides))
        return layers, served

    def linears(self) -> list[linear_ops.RoutedLinear]:
        """Every layer's routed products (the output layer is not among them)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The last norm [tokens, hidden] of a step's tokens, or of ctx.keep_rows' only where it is set (the
        others' last layer then stops after its attention, their KV written, where its products give a row the
        same bits in a call of fewer rows: RoutedLinear.rows_apart, always so in the layers' one call)."""
        m, ops, kernel = self.model, self.ops, self.kernel
        residual = m.embed_tokens(input_ids)                                 # [tokens, hidden], a new tensor
        cos, sin = self.rotary.cos_sin(residual, positions)
        tokens = residual.shape[0]
        caches = self._caches(ctx.kv_pool)
        rows, one_row = ctx.kernel_rows, ctx.one_row
        own = ctx.own_calls if self._own_calls else None
        # the attention in two calls (rotary_store, paged_decode) when the kernel takes every query row
        fused = self.fused_attention and rows is not None and not rows.rest
        # each residual add is done in place together with the next norm
        x = ops.add_rms_norm(residual, None, *self.norms[0])
        keep = ctx.keep_rows
        # (rows of a long prompt take the AMX tiles' route whatever the step's rows: the codes sum as a call of one
        # row, StepContext.own_calls)
        if fused and self.coded_layers is not None and tokens <= self.coded_rows and own is None:
            return self.coded_layers.forward(residual, x, cos, sin, ctx.slot_mapping, rows.tables, rows.lens, rows.tokens,
                                             rows.ends, self.sdpa_lanes, rows.qrows if self.mkl_order else None, one_row,
                                             keep)
        routes = self._routes(tokens if own is None else max(tokens, self._route_cap))
        for index, layer in enumerate(self.layers):
            qkv_of, o_of, gate_up_of, down_of = routes[index]
            k_cache, v_cache = caches[index]
            qkv = qkv_of(x, one_row, own)
            if fused:
                q = kernel.rotary_store(qkv, layer.num_heads, layer.num_kv_heads, cos, sin, k_cache, v_cache,
                                        ctx.slot_mapping)
                out = torch.empty_like(q)
                kernel.paged_decode(out, q, k_cache, v_cache, rows.tables, rows.lens, rows.tokens, layer.scaling,
                                    0, 0.0, None, None, 0, rows.ends, self.sdpa_lanes,
                                    rows.qrows if self.mkl_order else None)
            else:
                out = self._attention(layer, qkv, cos, sin, k_cache, v_cache, ctx)
            out = out.view(tokens, layer.q_size)
            if keep is not None and index == len(self.layers) - 1 and self._last_rows_apart:
                # past the last attention only the kept rows are read, and these products give them the same
                # bits in a call of fewer rows (a step that samples nothing reads none)
                if keep.shape[0] == 0:
                    return residual.new_empty((0, residual.shape[1]))
                residual, out = residual.index_select(0, keep), out.index_select(0, keep)
                one_row = one_row.index_select(0, keep) if one_row is not None else None
                _, o_of, gate_up_of, down_of = self._routes(keep.shape[0])[index]
                keep = None   # (the rows are the kept ones from here)
            x = ops.add_rms_norm(residual, o_of(out, one_row, own), *self.post_norms[index])
            x = ops.add_rms_norm(residual, down_of(ops.silu_mul(gate_up_of(x, one_row, own)), one_row, own),
                                 *self.norms[index + 1])
        return x if keep is None else x.index_select(0, keep)

    def _attention(self, layer: _Layer, qkv, cos, sin, k_cache, v_cache, ctx) -> torch.Tensor:
        """Attention by separate calls: the torch operations, Triton, or prompt runs the kernel leaves to
        the reference."""
        tokens = qkv.shape[0]
        q = qkv[:, :layer.q_size].view(tokens, layer.num_heads, layer.head_dim)
        k = qkv[:, layer.q_size:layer.q_size + layer.kv_size].view(tokens, layer.num_kv_heads, layer.head_dim)
        v = qkv[:, layer.q_size + layer.kv_size:].view(tokens, layer.num_kv_heads, layer.head_dim)
        q, k = self.ops.rotary(q, k, cos, sin)
        if self.attention_kernel is not None:
            self.attention_kernel.write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
            return attention_ops.paged_attention_cpu(self.attention_kernel, q, k_cache, v_cache, ctx.block_tables,
                                                     ctx.seq_lens, ctx.query_start_loc, layer.scaling,
                                                     work=ctx.kernel_rows, lanes=self.sdpa_lanes,
                                                     mkl_order=self.mkl_order)
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping, backend=ctx.backend)
        return paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                               layer.scaling, ctx.max_query_len, kernel_rows=ctx.kernel_rows, backend=ctx.backend)

    def _routes(self, rows: int) -> list[tuple]:
        """Per layer, the functions of its four products for a step of `rows` rows (RoutedLinear.route),
        chosen once per row count: the routes differ only up to a few rows, so counts beyond those share one
        entry."""
        key = min(rows, self._route_cap)
        routes = self._route_cache.get(key)
        if routes is None:
            routes = [tuple(lin.route(rows) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
                      for layer in self.layers]
            self._route_cache[key] = routes
        return routes

    def _caches(self, pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views of the pool, made once per pool (and handed to the one call then)."""
        if self._pool is not pool:
            self._pool, self._pool_views = pool, [(pool[i][0], pool[i][1]) for i in range(len(self.layers))]
            if self.coded_layers is not None:
                self.coded_layers.set_caches([cache for pair in self._pool_views for cache in pair])
        return self._pool_views


class _Rotary:
    """The rotary embedding's cos and sin for a step's positions: rows of tables made once by the model's
    own rotary module for every position, when its values do not depend on the sequence (not a dynamic
    scaling) and the tables give its per-call values bit for bit (checked at start); else the module
    called at every step."""

    def __init__(self, module, limit: int, dtype: torch.dtype):
        self.module, self.limit = module, limit
        self.cos = self.sin = None
        kind = str(getattr(module, "rope_type", "default"))
        if "dynamic" in kind or "longrope" in kind or limit <= 0:
            return
        probe = torch.zeros(1, 1, 1, dtype=dtype)
        cos, sin = self._call(probe, torch.arange(limit))
        checks = [torch.tensor([0]), torch.tensor([limit - 1]), torch.arange(3, 40),
                  torch.randperm(limit, generator=torch.Generator().manual_seed(0))[:64]]
        if all(torch.equal(a, cos.index_select(0, p)) and torch.equal(b, sin.index_select(0, p))
               for p in checks for a, b in [self._call(probe, p)]):
            self.cos, self.sin = cos, sin

    def _call(self, x: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.module(x, position_ids=positions[None])   # [1, tokens, dim]
        return cos[0].contiguous(), sin[0].contiguous()

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor):
        if self.cos is not None:
            try:
                return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
            except IndexError:   # a position beyond the tables: the module's own values
                pass
        return self._call(x[None], positions)


def build(model, codes: bool | dict = True) -> tuple[LlamaForward | None, str | None]:
    """(the lean forward, None) for a model that qualifies, else (None, why not). `codes`: read the
    weights that are exactly GGUF codes expanded as codes (ops/quantized.py); for a bfloat16 model, the
    codes found per module while it was float32 (quantized.codes_by_module)."""
    why = unsupported_reason(model)
    return (None, why) if why else (LlamaForward(model, codes=codes), None)
