"""Paged attention ops: shape checks, then dispatch: Triton on CUDA; on CPU the C++ decode kernel
(pagedserve_kernels/cpu, float32 or bfloat16) for one-token rows and for the rows of prompt runs of up to
KERNEL_MAX_QUERY tokens (each query token as a row of its own, see `KernelRows`), the torch
reference (causal SDPA over the gathered context) for longer runs (in the tile order, AMX, only those that are a
whole prompt: `Backend.prompt_chunks`).

Cache layout, one tensor per layer and per K/V:

    cache[num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block_id * block_size + offset``; slot -1 is padding and is skipped.

The flattened batch of one step holds, for sequence ``s``, the query tokens
``query_start_loc[s] : query_start_loc[s + 1]``. These are the *last* ``q_len`` tokens of the
sequence's context of ``seq_lens[s]`` tokens (their K/V were written to the cache before the
attention call), so query token ``i`` of ``s`` sits at position ``seq_lens[s] - q_len + i`` and
attends causally to positions ``0 .. that position``::

    context of s:  [ t0 t1 t2 ... t(L-q) | t(L-q+1) ... t(L-1) ]
                     cached by earlier     query tokens of this step
                     steps (or prefix)     (written just before)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ops import cpu_kernels, reference


def use_triton(device: torch.device) -> bool:
    """Whether this process serves attention through Triton on `device`: read once, at start (`choose`).
    PAGEDSERVE_TRITON=1 forces the Triton path (with TRITON_INTERPRET=1 on CPU, for tests);
    PAGEDSERVE_TRITON=0 forces the torch reference even on CUDA; unset, Triton on CUDA."""
    forced = os.environ.get("PAGEDSERVE_TRITON")
    if forced is not None:
        return forced == "1"
    return device.type == "cuda"


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def torch_sdpa_lanes(dtype: torch.dtype) -> int:
    """The lanes of torch's CPU vectors (16 with AVX-512, 8 with AVX2), whose flash-attention kernel computes
    transformers' bfloat16 SDPA: the C++ kernel then follows its steps for bfloat16 rows (pagedserve_kernels/cpu/
    paged_decode.cpp); 0 (the kernel's own order) for float32, or where torch's vectors are other."""
    if dtype != torch.bfloat16:
        return 0
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


@dataclass(frozen=True)
class Backend:
    """Which implementation serves the attention and cache ops on one device and dtype, chosen once at
    start (`choose`) and passed to every call, so that no call reads a setting or builds anything."""
    device_type: str
    dtype: torch.dtype
    triton: bool
    kernel: object | None = None   # the C++ module (pagedserve_kernels/cpu) when it serves this device and dtype
    sdpa_lanes: int = 0            # > 0: the kernel's bfloat16 rows in torch's SDPA order (torch_sdpa_lanes)
    mkl_order: bool = False        # and their two products in MKL's order (ops/sdpa_order.py)
    # and a prompt's runs of any length in the kernel where a run is not the whole prompt (kernel_rows' `chunks`):
    # in the tile order (AMX) the kernel's rows are those of transformers' call at every prompt length
    prompt_chunks: bool = False

    def describe(self) -> str:
        """The choice in words, for the start-up log."""
        if self.triton:
            return "triton"
        if self.kernel is not None:
            return (f"cpu kernel for decode rows and prompt runs of up to {KERNEL_MAX_QUERY} tokens"
                    + (" (and longer runs of part of a prompt)" if self.prompt_chunks else "") + ", torch reference above")
        if self.device_type != "cpu":
            why = "Triton turned off by PAGEDSERVE_TRITON=0"
        elif not cpu_kernels.enabled():
            why = "disabled by PAGEDSERVE_CPU_KERNELS=0"
        else:
            why = cpu_kernels.failure() or f"the CPU kernel is float32 and bfloat16 only, not {self.dtype}"
        return f"torch reference ({why})"

    def serves_kernel(self, query: torch.Tensor, k_cache: torch.Tensor):
        """The C++ module for a call whose tensors it takes (the chosen dtype on the CPU), else None."""
        if self.kernel is None or query.dtype != self.dtype or k_cache.dtype != self.dtype \
                or query.device.type != "cpu":
            return None
        return self.kernel


def choose(device: torch.device, dtype: torch.dtype, triton: bool | None = None) -> Backend:
    """The backend for this device and dtype (builds the CPU kernel if needed). `triton`: True or False
    to choose the path; None reads it from the environment (`use_triton`)."""
    if triton is None:
        triton = use_triton(device)
    kernel = None
    if not triton and device.type == "cpu" and dtype in KERNEL_DTYPES:
        kernel = cpu_kernels.load()
    lanes = torch_sdpa_lanes(dtype) if kernel is not None else 0
    mkl_order = False
    if lanes:
        from ops import sdpa_order
        mkl_order = sdpa_order.mkl_order_matches(kernel, lanes)
    return Backend(device.type, dtype, triton, kernel, lanes, mkl_order, mkl_order and kernel.sdpa_tile_order())


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, f"cache must be [blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, "K and V caches differ in shape"


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: Backend | None = None) -> None:
    """Store key/value [tokens, kv_heads, head_dim] into their slots (slot -1: skipped). `backend`: the
    caller's choice made at start (None: `choose` now, for a caller outside a step)."""
    _check_cache(k_cache, v_cache)
    assert key.shape == value.shape and key.dim() == 3, f"key must be [tokens, kv_heads, head_dim], got {tuple(key.shape)}"
    assert key.shape[1:] == k_cache.shape[2:], "key heads/dim do not match the cache"
    assert slot_mapping.shape == (key.shape[0],), "one slot per token"
    backend = backend or choose(key.device, key.dtype)
    if backend.triton:
        from pagedserve_kernels.cache_ops import write_kv_triton
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    kernel = backend.serves_kernel(key, k_cache)
    if kernel is not None and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value)) \
            and k_cache.is_contiguous() and v_cache.is_contiguous():
        # one call, no read-back of the slots (the reference masks padding with a device sync)
        kernel.write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int | None = None, *, sliding_window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    alibi: torch.Tensor | None = None, chunk: int | None = None,
                    kernel_rows: KernelRows | None = None, backend: Backend | None = None) -> torch.Tensor:
    """Causal attention of query [tokens, heads, head_dim] over the paged cache; returns the same shape.

    block_tables: int32 [seqs, max_blocks] (unused entries any value, conventionally 0);
    seq_lens: int32 [seqs], context length including this step's tokens;
    query_start_loc: int32 [seqs + 1], cumulative query lengths.
    max_query_len: the longest query of the batch if the caller knows it (1 means pure decode).
    sliding_window: W > 0 lets the query at position i see only keys i - W < j <= i (transformers'
        convention: W positions, its own included); None or 0: the whole causal context.
    softcap: c > 0 turns each scaled score s into c * tanh(s / c) before the softmax (Gemma 2).
    sinks: float32 [heads]: a logit per query head that joins the softmax's denominator and adds no
        value row (GPT-OSS's attention sinks).
    alibi: float32 [heads]: ALiBi slopes m; the query at position i adds m * (j - i) to the (capped)
        score of key j (BLOOM, MPT, Falcon with alibi).
    chunk: C > 0 lets the query at position i see only keys of its own chunk, i // C == j // C (Llama 4's
        chunked attention); with a window too, both apply.
    kernel_rows: `kernel_rows(query_start_loc, seq_lens, block_tables)` when the caller made it once
        for the step (the CPU kernel's input; every layer of a step would otherwise make it again).
    backend: the caller's choice made at start (None: `choose` now, for a caller outside a step).
    """
    _check_cache(k_cache, v_cache)
    assert query.dim() == 3 and query.shape[2] == k_cache.shape[3], "query must be [tokens, heads, head_dim]"
    assert query.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of kv heads"
    num_seqs = seq_lens.shape[0]
    assert block_tables.shape[0] == num_seqs and query_start_loc.shape[0] == num_seqs + 1
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    if chunk is not None and chunk < 0:
        raise ValueError(f"chunk must be positive or None, got {chunk}")
    for name, per_head in (("sinks", sinks), ("alibi", alibi)):
        if per_head is not None and (per_head.shape != (query.shape[1],) or per_head.dtype != torch.float32
                                     or per_head.device != query.device):
            raise ValueError(f"{name} must be float32 [heads] = [{query.shape[1]}] on {query.device}, got "
                             f"{per_head.dtype} {tuple(per_head.shape)} on {per_head.device}")
    sliding_window, softcap, chunk = sliding_window or None, softcap or None, chunk or None
    variant = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, alibi=alibi, chunk=chunk)
    backend = backend or choose(query.device, query.dtype)
    if backend.triton:
        from pagedserve_kernels.paged_attention import paged_attention_triton
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                      scale, max_query_len, **variant)
    kernel = backend.serves_kernel(query, k_cache)
    if kernel is not None:
        return paged_attention_cpu(kernel, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   scale, work=kernel_rows, lanes=backend.sdpa_lanes, mkl_order=backend.mkl_order,
                                   **variant)
    return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     scale, max_query_len, **variant)


# prompt runs of up to this many query tokens go through the CPU kernel, one row per token (each row
# reads its own causal context); longer runs through SDPA, which shares a key tile between many
# queries. Two reasons for the bound. A bfloat16 prompt of up to 193 tokens gets transformers' bits from
# the kernel, in one run or in chunks over several steps (each row follows the one SDPA call transformers
# makes over the whole prompt), where SDPA over a chunk is a call transformers never makes; from 194
# tokens on, a few rows past about a hundred keys differ from it (the order of torch's products over query
# blocks of 32-64 rows there is not read yet; in the tile order, AMX, no row differs at any length). And up to
# here the kernel is the faster of the two on SmolLM2's shapes (docs/performance.md, thirty-fourth session).
KERNEL_MAX_QUERY = 192


@dataclass
class KernelRows:
    """The CPU kernel's work for one step, made once for every layer: each query token it takes is a
    row with a context of its own (row r is query token tokens[r] and attends to the first lens[r]
    positions of tables[r]), so prompt rows and decode rows go through the same one-token kernel."""
    tokens: torch.Tensor    # int64 [R]: the query token of row r
    tables: torch.Tensor    # int32 [R, max_blocks]: the block table of row r's sequence
    lens: torch.Tensor      # int32 [R]: the positions row r attends to, its own included
    rest: list[int]         # sequences whose query runs are longer: the reference's
    # int32 [R]: the keys of the one call in which transformers computes row r (a prompt's rows in one call
    # over the prompt, a later token alone over its context; see kernel_rows)
    ends: torch.Tensor | None = None
    # int32 [R]: the query rows of that call's block in which torch's flash attention computes row r (1 for a
    # decode row, -1 for a prompt's row alone in its block, whose products the kernel finds from the call's shape):
    # the shape of the two products whose order the kernel can follow (Backend.mkl_order)
    qrows: torch.Tensor | None = None


def kernel_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                max_query: int = KERNEL_MAX_QUERY, prompt_lens: torch.Tensor | None = None,
                chunks: bool = False) -> KernelRows:
    """`prompt_lens` (int32 [S], each sequence's prompt tokens), where the caller knows them: the call in
    which transformers computes each row follows from its position (a prompt's rows in one call over the
    prompt, every later token a call of its own), even when a prompt comes in chunks. Without, a
    sequence's rows are one call over its length after the step, or a decode call for a run of one.
    Runs of more than `max_query` tokens are the reference's (`rest`: torch's SDPA over the run, which is
    transformers' call where the run is a whole prompt), except with `chunks` (Backend.prompt_chunks) and
    `prompt_lens` the runs that are not a whole prompt: those the kernel's too."""
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=starts.device), q_lens)
    kernels = q_lens <= max_query
    if chunks and prompt_lens is not None:
        kernels = kernels | (q_lens != seq_lens.long()) | (seq_lens.long() != prompt_lens.long())
    short = kernels[seq_of_token]
    token = torch.nonzero(short).squeeze(1)
    seq = seq_of_token.index_select(0, token)
    # token t of sequence s sits at position seq_lens[s] - (end of s - t): it sees that many + 1
    lens = seq_lens.long().index_select(0, seq) - starts[1:].index_select(0, seq) + token + 1
    if prompt_lens is None:
        ends, qrows = _calls(lens - 1, seq_lens.long().index_select(0, seq), q_lens.index_select(0, seq) == 1)
    else:
        ends, qrows = transformers_calls(lens - 1, prompt_lens.long().index_select(0, seq))
    return KernelRows(token.contiguous(), block_tables.to(torch.int32).index_select(0, seq).contiguous(),
                      lens.to(torch.int32).contiguous(), torch.nonzero(~kernels).squeeze(1).tolist(), ends, qrows)


def decode_rows(row_ids: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                prompt_lens: torch.Tensor) -> KernelRows:
    """The kernel's rows for a step of one new token per sequence, row r that of sequence r (`row_ids`:
    0 .. R - 1); `prompt_lens` as for kernel_rows (a prompt's last token may come alone)."""
    return KernelRows(row_ids, block_tables, seq_lens, [], *transformers_calls(seq_lens.long() - 1, prompt_lens.long()))


def transformers_calls(position: torch.Tensor, prompt_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row at `position` of a sequence with a prompt of `prompt_len` tokens: the keys of the call in which
    transformers' generate computes it, and the query rows of its block in torch's flash attention."""
    prompt = position < prompt_len
    return _calls(position, torch.where(prompt, prompt_len, position + 1), ~prompt)


def _calls(position: torch.Tensor, keys: torch.Tensor, decode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, query rows) as int32: torch's flash attention splits a call's queries into blocks of 32 (under
    192 queries), 64 (under 768) or 256; a decode row is a call of one (1), a prompt's row alone in its block -1
    (KernelRows.qrows)."""
    split = torch.where(keys < 192, 32, torch.where(keys < 768, 64, 256))
    first = torch.div(position, split, rounding_mode="floor") * split
    block = torch.minimum(split, keys - first)
    rows = torch.where(decode, torch.ones_like(keys), torch.where(block == 1, -torch.ones_like(keys), block))
    return keys.to(torch.int32).contiguous(), rows.to(torch.int32).contiguous()


def paged_attention_cpu(kernel, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *,
                        sliding_window=None, softcap=None, sinks=None, alibi=None, chunk=None,
                        work: KernelRows | None = None, lanes: int = 0, mkl_order: bool = False):
    """The kernel's rows (decode rows and short prompt runs) straight from the blocks; longer prompt
    runs through the reference's causal SDPA over the gathered context. `lanes` > 0: bfloat16 rows in
    torch's SDPA order (Backend.sdpa_lanes), and with `mkl_order` their products in MKL's order."""
    out = torch.empty_like(query)
    work = kernel_rows(query_start_loc, seq_lens, block_tables) if work is None else work
    if work.tokens.numel():
        # 0 means none to the kernel
        kernel.paged_decode(out, query, k_cache.contiguous(), v_cache.contiguous(), work.tables, work.lens,
                            work.tokens, float(scale), int(sliding_window or 0), float(softcap or 0.0), sinks,
                            alibi, int(chunk or 0), work.ends, lanes, work.qrows if mkl_order else None)
    if work.rest:
        start_list, seq_len_list = query_start_loc.tolist(), seq_lens.tolist()
        for s in work.rest:
            begin, end = start_list[s], start_list[s + 1]
            out[begin:end] = reference.extend_one(query[begin:end], k_cache, v_cache, block_tables[s],
                                                  seq_len_list[s], scale, sliding_window, softcap, sinks=sinks,
                                                  alibi=alibi, chunk=chunk)
    return out
