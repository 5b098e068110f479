"""Decode steps replayed from CUDA graphs: one graph per padded batch size, captured at start.

A decode-only step of B sequences (one new token each) is padded up to the smallest bucket >= B
and run on that bucket's static input buffers: the step's token ids, positions, slots, block
tables and context lengths are copied in, the rows past B are padding, and on CUDA the graph
captured for the bucket replays the whole forward with one launch instead of one per kernel.

Padding rows are inert: token 0 at position 0, slot -1 (its K/V are not written), a context of
one token read from block 0 of a zeroed pool entry or of any block (finite values either way),
and their outputs are dropped. Every row of the forward (products, norms, attention) depends on
its own row only, so the real rows' numbers are those of the unpadded step.

The block tables are as wide as the longest sequence the model allows (max_model_len), so the
attention kernels see the same shapes at every replay; the Triton decode launch takes its bound
on the context from the table's width, not from the lengths, and reads nothing back from the
device (pagedserve_kernels/paged_decode.py), so it can be captured.

On the CPU nothing is captured: `DecodeGraphs(capture=False)` runs the same padded static path
eagerly, which is how the tests check buckets, padding and the buffers without a GPU.
"""
from __future__ import annotations

import logging
import time

import torch

from data_plane.attention import StepContext
from ops.attention import Backend, KernelRows

log = logging.getLogger("pagedserve.data_plane")

BUCKET_STEPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MAX_BATCH = 256   # larger decode steps run eagerly (the control plane's default batch is 128)


def buckets_up_to(max_num_seqs: int) -> list[int]:
    """The padded batch sizes for a batch of at most `max_num_seqs`: powers of two up to 16, then
    steps of 8, 16 and 32 (a step always has fewer padding rows than real ones), the last one
    covering `max_num_seqs`."""
    sizes = [b for b in BUCKET_STEPS if b < max_num_seqs]
    top = next((b for b in BUCKET_STEPS if b >= max_num_seqs), -(-max_num_seqs // 32) * 32)
    return sizes + [top]


def reserve_bytes(max_bucket: int, hidden: int, intermediate: int, q_size: int, dtype_bytes: int) -> int:
    """What the graphs' memory pool holds at most: the activations of the largest bucket's forward
    (each live tensor of one layer, four times over for the temporaries), plus 256 MiB for the
    attention's split-context buffers and the allocator's rounding. Taken off the device's free
    memory before the KV pool is sized."""
    per_row = 4 * (2 * hidden + 2 * intermediate + 3 * q_size) * dtype_bytes
    return max_bucket * per_row + 256 * 2**20


class StaticBatch:
    """The input buffers of one bucket."""

    def __init__(self, size: int, max_blocks: int, kv_pool: torch.Tensor, device: torch.device,
                 backend: Backend | None = None):
        self.size = size
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, size, dtype=torch.long, device=device)
        self.ctx = StepContext(kv_pool=kv_pool,
                               slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=device),
                               block_tables=torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
                               seq_lens=torch.ones(size, dtype=torch.int32, device=device),
                               query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
                               max_query_len=1, backend=backend)
        # every row a decode row of its own sequence: the CPU kernel reads the static tables and lengths
        self.ctx.kernel_rows = KernelRows(torch.arange(size, device=device), self.ctx.block_tables,
                                          self.ctx.seq_lens, [])

    def load(self, ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> None:
        """Copy a decode step of B <= size rows in; the rows past B become padding."""
        rows, width = ids.shape[1], ctx.block_tables.shape[1]
        c = self.ctx
        self.ids[:, :rows].copy_(ids)
        self.ids[:, rows:].zero_()
        self.positions[:, :rows].copy_(positions)
        self.positions[:, rows:].zero_()
        c.slot_mapping[:rows].copy_(ctx.slot_mapping)
        c.slot_mapping[rows:].fill_(-1)
        c.block_tables[:rows, :width].copy_(ctx.block_tables)
        c.block_tables[:rows, width:].zero_()
        c.block_tables[rows:].zero_()
        c.seq_lens[:rows].copy_(ctx.seq_lens)
        c.seq_lens[rows:].fill_(1)


class DecodeGraphs:
    """`forward(ids [1, T], positions [1, T], ctx) -> hidden [T, hidden]` for decode-only steps, through
    the buckets' static buffers; `run` answers None for a step it does not cover."""

    def __init__(self, forward, kv_pool: torch.Tensor, max_blocks: int, buckets: list[int],
                 device: torch.device, capture: bool, backend: Backend | None = None):
        self.forward = forward
        self.max_blocks = max_blocks
        self.buckets = sorted(buckets)
        self.batches = {b: StaticBatch(b, max_blocks, kv_pool, device, backend) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0
        if capture:
            self._capture(device)

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        started = time.perf_counter()
        pool = None
        for size in reversed(self.buckets):   # the largest first: the others fit in its memory pool
            batch = self.batches[size]
            for _ in range(2):                # warm-up outside the graph: Triton compiles, caches fill
                self.forward(batch.ids, batch.positions, batch.ctx)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(batch.ids, batch.positions, batch.ctx)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - started
        log.info("CUDA graphs captured for decode batches %s in %.1f s", self.buckets, self.capture_seconds)

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        rows = ids.shape[1]
        if ctx.max_query_len != 1 or ctx.seq_lens.shape[0] != rows or ctx.block_tables.shape[1] > self.max_blocks:
            return None
        size = self.bucket_for(rows)
        if size is None:
            return None
        batch = self.batches[size]
        batch.load(ids, positions, ctx)
        self.replays += 1
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self.forward(batch.ids, batch.positions, batch.ctx)
        return out[:rows]
