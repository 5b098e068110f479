"""Loads the model, keeps what the data plane knows of each sequence, and executes step plans.

One step: swap/copy orders first, then one forward pass over the flattened tokens of all
scheduled sequences (no padding), then sampling of the sequences whose known tokens are
now all computed. The runner makes no scheduling decision: it does what the plan says.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from data_plane import attention, block_tables, decode_graphs, kv_pool, llama_forward, model_support, prompt_logprobs, sampler
from data_plane.state_pool import DEFAULT_NUM_SLOTS, StatePool, StateStep
from data_plane.swap import SwapPool
from ops import attention as attention_ops
from ops import cpu_kernels, greedy_head
from ops import linear as linear_ops
from ops import quantized
from ops import warmup
from ops.cache_ops import copy_blocks
from shared.config import DTYPE_BYTES, MIN_TRITON_BLOCK_SIZE, ConfigError, DataPlaneConfig, kv_block_bytes, split_model_path
from shared.protocol import FREED_BLOCK_ID, NO_STATE_SLOT, Handshake, NewSequence, SampledToken, SamplingSpec, StepPlan, StepResult

log = logging.getLogger("pagedserve.data_plane")


@dataclass
class SeqState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingSpec
    row: int = -1        # its row of the runner's BlockTables
    slot: int = NO_STATE_SLOT   # its slot of the state pool (a model with state layers)


class PlanError(ValueError):
    """A plan that names unknown sequences or out-of-range blocks: refused before any work."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(config: DataPlaneConfig, device: torch.device):
    """The model on `device`, or model_support.UnsupportedModel (a ConfigError) naming the architecture
    and why pagedserve cannot serve it exactly; the config is checked before any weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder, gguf_file = split_model_path(config.model)
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    model_support.check_config(hf_config)
    # a GGUF file served in bfloat16 on the CPU is loaded in float32 first, where its weights are still
    # exactly their codes (ModelRunner finds them, then narrows the model: the same bfloat16 values
    # as loading it in bfloat16)
    wide_first = gguf_file is not None and config.dtype == "bfloat16" and config.gguf_codes and device.type == "cpu"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, dtype=torch.float32 if wide_first else getattr(torch, config.dtype),
            attn_implementation=attention.register())
    except KeyError as exc:
        refusal = model_support.load_refusal(model_support.architecture(hf_config), exc)
        if refusal is None:
            raise
        raise refusal from None
    model = model.to(device).eval()
    model_support.check_model(model)
    return model


class ModelRunner:
    def __init__(self, model, config: DataPlaneConfig, device: torch.device, sample=sampler.sample):
        """Start-up in phases: the model in its serving type, the KV pool, the kernels' warm-up, the forward
        and its linear routes, the decode graphs."""
        self.device = device
        self.sample = sample   # (logits, SampleRows) -> draws per row: sampler.sample, or a tensor-parallel rank's
        # a step's rows that sample nothing may skip the last layer past its attention (the forward's keep_rows)
        self.skip_unsampled = True
        wide_codes = self._load(model, config)
        capture, graph_buckets = self._allocate_pool(config)
        self.seqs: dict[int, SeqState] = {}
        # a row holds every group's table, interleaved (data_plane/kv_pool.py)
        self.tables = block_tables.BlockTables(-(-self.max_model_len // self.block_size) * self.layout.num_groups)
        self._arange = torch.arange(64, dtype=torch.int64, device=device)
        heads = (getattr(self.model.config, "num_attention_heads", None) or self.num_kv_heads) \
            // config.tensor_parallel_size
        # (a pool of no layer, Mamba's, has no cache to compile the kernels on, and no layer calls them)
        compiled = warmup.warm_up(self.layer_caches, heads, self.backend) if self.layer_caches else None
        if compiled is not None:
            log.info("Triton kernels compiled for every kind of step in %.1f s", compiled)
        routes, why_not = self._route(config, wide_codes)
        if self.device.type == "cpu":
            started = time.perf_counter()
            if linear_ops.warm_up(linear_ops.routed_in(self.model) + (self.lean.linears() if self.lean else [])):
                log.info("oneDNN's bfloat16 GEMM kernels made for steps of 1-%d rows in %.1f s", linear_ops.WARM_ROWS,
                         time.perf_counter() - started)
        # greedy rows that want no log-prob skip most logits (ops/greedy_head.py): CPU, one rank
        started = time.perf_counter()
        self.greedy_head = greedy_head.build(self.final_logits, cpu_kernels.load()) \
            if self.device.type == "cpu" and config.tensor_parallel_size == 1 else None
        if self.greedy_head is not None:
            log.info("greedy head: greedy rows that ask for no log-prob take their token from an int8 first pass "
                     "and the exact logits of its few candidates (%.1f MiB laid out for %s in %.1f s, %s), from %d "
                     "rows", self.greedy_head.nbytes / 2**20, self.greedy_head.kind, time.perf_counter() - started,
                     "the layer's codes" if self.greedy_head.codes is not None else "codes found near its weights",
                     self.greedy_head.min_rows)
        self.graphs = None
        # (not for state layers: their per-sequence forward is not captured; nor with layer groups, whose tables
        # the graphs do not hold: so the graphs' steps run on a pool whose slab of a layer is the layer's index)
        if (config.decode_graphs == "eager" or capture) and self.states is None and self.layout.groups is None:
            self.graphs = decode_graphs.DecodeGraphs(self._forward_eager, self.pool,
                                                     -(-self.max_model_len // self.block_size), graph_buckets,
                                                     device, capture, self.backend)
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB, K/V of %d of %d layers) on %s; attention ops: %s; "
                 "forward: %s; linear layers: %d read as GGUF codes, %d as float32 panels, %d with the few-row "
                 "kernel, %d with prepacked GEMM, %d in the order of torch's own bfloat16 GEMM", self.num_blocks, self.block_size, self.num_blocks * self.block_bytes / 2**20,
                 self.num_kv_layers, self.num_layers, device,
                 self.backend.describe(),
                 "pagedserve's Llama forward" if self.lean else f"transformers' ({why_not})",
                 routes["codes"], routes["panels"], routes["kernel"], routes["packed"], routes["dots"])
        if self.states is not None:
            log.info("state pool: %d slots of %.1f KiB (layers %s)%s; no prefix caching for a model with state "
                     "layers", self.states.num_slots, self.states.slot_bytes / 1024, sorted(self.states.states),
                     ", as many in CPU memory for swapping" if self.states.cpu_states is not None else "")

    def _load(self, model, config: DataPlaneConfig) -> dict | None:
        """The model in the serving type, its shapes, and whether it can be served exactly (refused
        otherwise); returns the GGUF codes found while a model to be served in bfloat16 was float32."""
        self.dtype = getattr(torch, config.dtype)
        # a float32 model to be served in bfloat16 (load_model): its GGUF codes are found while it is float32
        wide_codes = quantized.codes_by_module(model) if model.dtype == torch.float32 and \
            self.dtype == torch.bfloat16 and config.gguf_codes and self.device.type == "cpu" else None
        model = model.to(self.dtype)
        self.model = model
        self.block_size = config.block_size
        # the attention and cache ops' implementation, decided here once and passed to every call
        self.backend = attention_ops.choose(self.device, self.dtype)
        if self.backend.triton and self.block_size < MIN_TRITON_BLOCK_SIZE:
            raise ConfigError(f"--block-size {self.block_size} is for the CPU path; the Triton kernels "
                              f"({self.device}) need {MIN_TRITON_BLOCK_SIZE} or more")
        mc = model.config
        self.num_layers = mc.num_hidden_layers
        # with tensor parallelism each rank's pool holds only its own KV heads (data_plane/tensor_parallel.py)
        self.num_kv_heads = model_support.kv_heads(mc) // config.tensor_parallel_size
        self.head_dim = model_support.head_dim(mc)
        model_max = getattr(mc, "max_position_embeddings", None) or 2048
        self.max_model_len = min(model_max, config.max_model_len or model_max)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # refuses what cannot be served exactly; picks the model's own logits path (soft-cap, scaling)
        support = model_support.check_model(model)
        self.final_logits = support.final_logits
        self._state_shapes = support.state_shapes
        # the layers with a K/V slab in the pool: all but the state layers of a hybrid model (the probe has
        # checked that these are the layers that call attention), in groups by how far back they read, and
        # the map to their slabs and groups, made once here
        attending = model_support.attention_layers(mc)
        self.num_kv_layers = len(attending)
        self.layout = model_support.pool_layout(model)
        self.kv_slabs = self.layout.slabs
        if support.state_shapes and config.tensor_parallel_size > 1:
            raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size}: a model with state layers "
                              "(layers " + ", ".join(map(str, sorted(support.state_shapes))) + ") is served on one "
                              "rank only; its state layers are not split across ranks")
        self.model_id = config.model
        return wide_codes

    def _allocate_pool(self, config: DataPlaneConfig) -> tuple[bool, list[int]]:
        """The KV pool on the device (less what decode graphs will need) and the swap space; returns
        whether graphs are captured, and their batch sizes."""
        mc, device = self.model.config, self.device
        block_bytes = kv_block_bytes(self.layout.num_slabs, self.block_size, self.num_kv_heads, self.head_dim,
                                     config.dtype)
        # not with tensor parallelism (its all_reduce between ranks is not captured), nor with state layers
        # (their per-sequence forward is not either)
        capture = config.decode_graphs == "auto" and device.type == "cuda" and config.tensor_parallel_size == 1 \
            and not self._state_shapes
        graph_buckets = decode_graphs.buckets_up_to(decode_graphs.MAX_BATCH)
        reserve = decode_graphs.reserve_bytes(
            graph_buckets[-1], mc.hidden_size, getattr(mc, "intermediate_size", 4 * mc.hidden_size),
            mc.num_attention_heads * self.head_dim, DTYPE_BYTES[config.dtype]) if capture else 0
        if self.num_kv_layers:
            self.num_blocks = kv_pool.choose_num_blocks(block_bytes, device, config.kv_cache_blocks,
                                                        config.kv_cache_gib, reserve)
            swap_blocks = SwapPool.blocks_for_budget(block_bytes, config.swap_blocks, config.swap_space_gib)
        else:
            # no layer attends (Mamba): a pool of no slabs, whose blocks hold no bytes and only count the tokens
            # the control plane admits; a budget in bytes would make them countless, so there are as many as
            # every state slot's sequence needs at full length, or fewer when asked for in blocks
            cap = DEFAULT_NUM_SLOTS * -(-self.max_model_len // self.block_size)
            self.num_blocks = min(cap, config.kv_cache_blocks or cap)
            swap_blocks = min(cap, config.swap_blocks) if config.swap_blocks is not None else \
                cap if config.swap_space_gib > 0 else 0
        self.pool = kv_pool.allocate_pool(self.layout.num_slabs, self.num_blocks, self.block_size, self.num_kv_heads,
                                          self.head_dim, self.dtype, device)
        self.swap = SwapPool(self.pool, swap_blocks)
        # layers with a per-sequence state: a slot each per sequence, and as many in CPU memory with swap space
        self.states = StatePool(self._state_shapes, DEFAULT_NUM_SLOTS, self.dtype, device,
                                swap=self.swap.num_blocks > 0) if self._state_shapes else None
        self.block_bytes = block_bytes
        # per slab and K/V, views of the pool shaped [blocks, block_size, kv_heads, head_dim]
        self.layer_caches = [self.pool[slab, kv] for slab in range(self.layout.num_slabs) for kv in (0, 1)]
        return capture, graph_buckets

    def _route(self, config: DataPlaneConfig, wide_codes: dict | None) -> tuple[dict[str, int], str | None]:
        """The forward and the routes of the linear layers; returns the count of layers by route, and
        why the lean forward is not used (None when it is)."""
        # a Llama-shaped float32 or bfloat16 CPU model runs the lean forward; its linear layers, and every other
        # model's, are routed: weights that are exactly GGUF codes expanded through the kernel reading
        # the codes, others by row count: few rows through the kernel, more through prepacked GEMM
        model = self.model
        codes = config.gguf_codes if wide_codes is None else wide_codes
        self.lean, why_not = llama_forward.build(model, codes) if config.lean_forward else (None, "--no-lean-forward")
        if self.lean is not None and self.layout.groups is not None:   # (its layers read one block table)
            self.lean, why_not = None, "layer groups"
        routes = linear_ops.route_linears(model.get_output_embeddings() if self.lean else model, codes=codes)
        if self.lean:
            for route, count in linear_ops.route_counts(self.lean.linears()).items():
                routes[route] += count
        return routes, why_not

    def handshake(self) -> Handshake:
        eos = self.model.generation_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        device = str(self.device)
        if self.device.type == "cuda":
            device += f" ({torch.cuda.get_device_name(self.device)})"
        # one group: its reach as the sliding window (0: none); several: each group's (data_plane/kv_pool.py).
        # The control plane frees blocks outside a window; their table entries come as -1
        one = self.layout.num_groups == 1
        return Handshake(self.model_id, self.vocab_size, self.layout.num_slabs, self.num_kv_heads, self.head_dim,
                         str(self.dtype).removeprefix("torch."), self.block_size, self.num_blocks,
                         self.swap.num_blocks,
                         self.max_model_len, device, eos_ids, sliding_window=self.layout.reaches[0] if one else 0,
                         num_state_slots=self.states.num_slots if self.states is not None else 0,
                         group_reaches=[] if one else self.layout.reaches)

    # --- plan bookkeeping -------------------------------------------------------------
    def _check_blocks(self, block_ids, table: bool = False) -> None:
        """Every id in range; a whole table sent with a sequence may also hold FREED_BLOCK_ID (-1) for
        blocks that left a sliding window (only when the model has one: _prepare checks where)."""
        freed_ok = table and self.layout.windowed
        for b in block_ids:
            if not 0 <= b < self.num_blocks and not (freed_ok and b == FREED_BLOCK_ID):
                raise PlanError(f"block id {b} out of range [0, {self.num_blocks})")

    def _apply_plan(self, plan: StepPlan) -> list[tuple[int, int]]:
        """Updates the sequence table; returns (seq_id, num_new_tokens) in plan order."""
        for seq_id in plan.forget_seq_ids:
            gone = self.seqs.pop(seq_id, None)
            if gone is not None:
                self.tables.release(gone.row)
        scheduled = []
        for new in plan.new_seqs:
            self._add(new)
            scheduled.append((new.seq_id, new.num_new_tokens))
        for cached in plan.cached_seqs:
            state = self.seqs.get(cached.seq_id)
            if state is None:
                raise PlanError(f"plan continues unknown sequence {cached.seq_id}")
            self._check_blocks(cached.new_block_ids)
            self._check_tokens(cached.seq_id, cached.new_token_ids)
            self.tables.extend(state.row, len(state.block_ids), cached.new_block_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.token_ids.extend(cached.new_token_ids)
            for index, block in cached.remaps:
                self._check_blocks([block])
                if not 0 <= index < len(state.block_ids):
                    raise PlanError(f"sequence {cached.seq_id}: remap of table entry {index} of "
                                    f"{len(state.block_ids)}")
                state.block_ids[index] = block
                self.tables.remap(state.row, index, block)
            scheduled.append((cached.seq_id, cached.num_new_tokens))
        return scheduled

    def _check_tokens(self, seq_id: int, token_ids) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PlanError(f"sequence {seq_id} has token ids outside the vocabulary: {bad[:5]}")

    def _add(self, new: NewSequence) -> None:
        self._check_blocks(new.block_ids, table=True)
        self._check_tokens(new.seq_id, new.token_ids)
        if self.states is not None:
            if new.state_slot == NO_STATE_SLOT:
                raise PlanError(f"sequence {new.seq_id} has no state slot; the model has state layers")
            try:
                self.states.check([new.state_slot])
            except ValueError as exc:
                raise PlanError(f"sequence {new.seq_id}: {exc}") from None
        old = self.seqs.get(new.seq_id)
        if old is not None:   # a sequence sent again whole (recomputed) takes a fresh row
            self.tables.release(old.row)
        self.seqs[new.seq_id] = SeqState(list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                                         list(new.block_ids), new.sampling, self.tables.add(list(new.block_ids)),
                                         new.state_slot)

    # --- execution ----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        try:
            self.swap.check(plan.swap_out, plan.swap_in)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        state_orders = plan.state_copies or plan.state_swap_out or plan.state_swap_in   # none for most models
        if state_orders:
            if self.states is None:
                raise PlanError("the plan copies or swaps state slots; the model has no state layers")
            if self.states.cpu_states is None and (plan.state_swap_out or plan.state_swap_in):
                raise PlanError("the plan swaps state slots; this data plane has no swap space")
            try:   # device and CPU slots are numbered alike
                self.states.check([slot for orders in (plan.state_copies, plan.state_swap_out, plan.state_swap_in)
                                   for pair in orders for slot in pair])
            except ValueError as exc:
                raise PlanError(str(exc)) from None
        scheduled = self._apply_plan(plan)
        # swap-out first: a block swapped out may be swapped into, or copied into, this same step
        self.swap.swap_out(plan.swap_out)
        self.swap.swap_in(plan.swap_in)
        if plan.copies:
            src, dst = zip(*plan.copies)
            self._check_blocks(src + dst)
            copy_blocks(self.layer_caches, torch.tensor(src), torch.tensor(dst), self.backend)
        if state_orders:   # forks' children start from their parents' states; then the swapped ones move
            self.states.copy(plan.state_copies)
            self.states.swap(plan.state_swap_out, out=True)
            self.states.swap(plan.state_swap_in, out=False)
        t1 = time.perf_counter()
        masks = dict(plan.token_masks)
        sampled, num_tokens, prompt_scores = self._forward_and_sample(scheduled, masks) if scheduled else ([], 0, [])
        t2 = time.perf_counter()
        return StepResult(plan.step_id, sampled, num_tokens, t2 - t1, t1 - t0, prompt_logprobs=prompt_scores)

    def _prepare(self, scheduled):
        input_ids, positions, seq_lens, starts, rows, sample_rows, prompt_lens = [], [], [], [0], [], [], []
        state_seqs, own_calls = [], []
        max_blocks = 1
        bs, groups, windowed = self.block_size, self.layout.num_groups, self.layout.windowed
        slots = [[] for _ in range(groups)]   # per group, where each new token's K/V goes
        for seq_id, num_new in scheduled:
            st = self.seqs[seq_id]
            begin, end = st.num_computed_tokens, st.num_computed_tokens + num_new
            if end > len(st.token_ids) or num_new < 1:
                raise PlanError(f"sequence {seq_id}: {num_new} new tokens from {begin} but "
                                f"{len(st.token_ids)} tokens are known")
            if -(-end // bs) * groups > len(st.block_ids):
                raise PlanError(f"sequence {seq_id}: {end} tokens need {-(-end // bs) * groups} table entries "
                                f"({groups} per block of tokens), table has {len(st.block_ids)}")
            table = st.block_ids
            if windowed and FREED_BLOCK_ID in table:   # -1 only comes with a window
                # freed entries lie before the block of `begin`, so no slot below reads one; the
                # attention reads the runner's BlockTables, which hold 0 there
                self._check_freed(seq_id, table, begin)
            if begin < st.num_prompt_tokens and st.num_prompt_tokens > linear_ops.TILE_CALL_ROWS:
                # (a chunk of the prompt: its rows at their places in a call of the whole prompt's rows)
                own_calls.append((starts[-1], starts[-1] + min(end, st.num_prompt_tokens) - begin,
                                  st.num_prompt_tokens, begin))
            input_ids.extend(st.token_ids[begin:end])
            positions.extend(range(begin, end))
            for g, group_slots in enumerate(slots):
                group_slots.extend(table[p // bs * groups + g] * bs + p % bs for p in range(begin, end))
            seq_lens.append(end)
            prompt_lens.append(st.num_prompt_tokens)
            starts.append(starts[-1] + num_new)
            rows.append(st.row)
            if self.states is not None:
                state_seqs.append((starts[-2], starts[-1], st.slot, begin == 0))
            max_blocks = max(max_blocks, len(table))
            if end == len(st.token_ids):
                sample_rows.append((seq_id, starts[-1] - 1))
        tables = self.tables.gather(rows, max_blocks).to(self.device)
        dev = self.device
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        starts_t = torch.tensor(starts, dtype=torch.int32, device=dev)
        decode_only = len(input_ids) == len(seq_lens)   # row r is sequence r's one new token
        prompt_lens_t = torch.tensor(prompt_lens, dtype=torch.int32, device=dev)
        views = [self._group_view(slots[g], tables if groups == 1 else tables[:, g::groups].contiguous(),
                                  seq_lens_t, starts_t, prompt_lens_t, decode_only) for g in range(groups)]
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)[None]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)[None]
        one_row = None
        if self.dtype == torch.bfloat16:   # the tokens transformers computes alone: past the prompt, or a prompt of one
            prompt_of = torch.repeat_interleave(prompt_lens_t, starts_t[1:] - starts_t[:-1])
            one_row = (pos[0] >= prompt_of) | (prompt_of == 1)
        ctx = attention.StepContext(
            kv_pool=self.pool, slot_mapping=views[0].slot_mapping, block_tables=views[0].block_tables,
            seq_lens=seq_lens_t, query_start_loc=starts_t,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])), backend=self.backend,
            kernel_rows=views[0].kernel_rows,
            one_row=one_row,
            own_calls=linear_ops.OwnCalls(own_calls, len(input_ids)) if self.dtype == torch.bfloat16 and own_calls
            else None,
            state=StateStep.build(self.states, state_seqs, dev) if self.states is not None else None,
            kv_slabs=self.kv_slabs, kv_groups=self.layout.groups, groups=views if groups > 1 else None)
        return ctx, ids, pos, sample_rows

    def _group_view(self, slots: list[int], tables: torch.Tensor, seq_lens: torch.Tensor,
                    starts: torch.Tensor, prompt_lens: torch.Tensor, decode_only: bool) -> attention.GroupStep:
        """One layer group's part of a step: its slots, its block tables and, on the CPU, the kernel's rows
        (made once for every layer of the group)."""
        rows = None
        if not self.backend.triton:
            if decode_only:
                rows = attention_ops.decode_rows(self._row_ids(seq_lens.shape[0]), tables, seq_lens, prompt_lens)
            else:
                rows = attention_ops.kernel_rows(starts, seq_lens, tables, prompt_lens=prompt_lens,
                                                 chunks=self.backend.prompt_chunks)
        return attention.GroupStep(torch.tensor(slots, dtype=torch.int64, device=self.device), tables, rows)

    def _row_ids(self, n: int) -> torch.Tensor:
        """0 .. n - 1 as int64, sliced from one tensor kept between steps."""
        if self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0]), dtype=torch.int64, device=self.device)
        return self._arange[:n]

    def _check_freed(self, seq_id: int, table: list[int], begin: int) -> None:
        """Freed entries may only be blocks that no query of this step, from position `begin` on, reads:
        those of a group with a window, wholly before begin - window + 1. The attention ops start at each
        query's window and never load them, so whatever the pool holds there (another sequence's KV) cannot
        leak in."""
        groups = self.layout.num_groups
        for g, reach in enumerate(self.layout.reaches):
            entries = table[g::groups]
            dead = max(0, begin - reach + 1) // self.block_size if reach else 0
            if FREED_BLOCK_ID in entries[dead:]:
                where = f"table entry {entries.index(FREED_BLOCK_ID, dead) * groups + g}" + \
                    (f" (group {g})" if groups > 1 else "")
                raise PlanError(f"sequence {seq_id}: a freed block (-1) at {where}, inside the window of its "
                                f"queries from position {begin} (window {reach or 'none'}, block size "
                                f"{self.block_size})")

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, ctx: attention.StepContext) -> torch.Tensor:
        """The last hidden states [tokens, hidden] of one step's flattened tokens ([1, tokens] ids and positions),
        or of ctx.keep_rows' only where it is set."""
        if self.graphs is not None and ctx.keep_rows is None:
            hidden = self.graphs.run(ids, pos, ctx)   # decode-only steps up to the largest bucket
            if hidden is not None:
                return hidden
        return self._forward_eager(ids, pos, ctx)

    def _forward_eager(self, ids: torch.Tensor, pos: torch.Tensor, ctx: attention.StepContext) -> torch.Tensor:
        if self.lean is not None:
            return self.lean(ids[0], pos[0], ctx)
        with attention.use_step_context(ctx):
            hidden = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
        return hidden if ctx.keep_rows is None else hidden.index_select(0, ctx.keep_rows)

    @torch.inference_mode()
    def _forward_and_sample(self, scheduled, masks: dict[int, bytes] | None = None):
        ctx, ids, pos, sample_rows = self._prepare(scheduled)
        slices = prompt_logprobs.plan_slices(scheduled, self.seqs)   # before num_computed_tokens advances
        rows = torch.tensor([r for _, r in sample_rows], dtype=torch.long, device=self.device)
        # prompt tokens nobody reads the logits of: the forward may leave their last layer after its attention
        if self.skip_unsampled and not slices and len(sample_rows) < ids.shape[1]:
            ctx.keep_rows = rows
        hidden = self._forward(ids, pos, ctx)
        prompt_scores = prompt_logprobs.compute(hidden, slices, self.final_logits, self.vocab_size) if slices else []
        for seq_id, num_new in scheduled:
            self.seqs[seq_id].num_computed_tokens += num_new
        if not sample_rows:
            return [], ids.shape[1], prompt_scores
        hidden_rows = hidden if ctx.keep_rows is not None else hidden.index_select(0, rows)
        sample_inputs = []
        for seq_id, _ in sample_rows:
            st = self.seqs[seq_id]
            first = len(st.token_ids) == st.num_prompt_tokens
            sample_inputs.append(sampler.SampleRow(st.sampling, st.token_ids, st.num_prompt_tokens,
                                                   st.sampling.n if first else 1, (masks or {}).get(seq_id)))
        result = []
        for (seq_id, _), draws in zip(sample_rows, self._draw(hidden_rows, sample_inputs)):
            st = self.seqs[seq_id]
            if not st.sampling.beam_width:   # a beam's next token is chosen by the control plane
                st.token_ids.append(draws[0].token_id)
            result.extend(SampledToken(seq_id, d.token_id, d.logprob, d.top_logprobs) for d in draws)
        return result, ids.shape[1], prompt_scores

    def _draw(self, hidden_rows: torch.Tensor, inputs: list[sampler.SampleRow]) -> list[list[sampler.SampleOutput]]:
        """Per sampled row its draws: rows that need only their argmax from the greedy head where there is
        one and they are enough of them (their log-prob, which nobody asked for, NaN), the others from the
        logits and the sampler."""
        draws: list = [None] * len(inputs)
        quick = [i for i, row in enumerate(inputs) if sampler.argmax_only(row)] if self.greedy_head else []
        if quick and len(quick) >= self.greedy_head.min_rows:
            index = torch.tensor(quick, device=self.device)
            tokens, _ = self.greedy_head.tokens(hidden_rows.index_select(0, index))
            for i, token in zip(quick, tokens):
                if token >= 0:
                    draws[i] = [sampler.SampleOutput(token, math.nan, [])]
        rest = [i for i, d in enumerate(draws) if d is None]
        if rest:
            part = hidden_rows if len(rest) == len(inputs) else \
                hidden_rows.index_select(0, torch.tensor(rest, device=self.device))
            for i, d in zip(rest, self.sample(self.final_logits(part), [inputs[i] for i in rest])):
                draws[i] = d
        return draws
