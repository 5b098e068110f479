"""Tensor parallelism of the model: attention heads and MLP columns split across the ranks of one
torch.distributed group, with one all_reduce after each row-parallel layer.

Which layer splits how comes from the architecture's own plan in transformers
(`config.base_model_tp_plan`; for Llama, Mistral, Qwen2/3 it names q/k/v/gate/up "colwise" and
o/down "rowwise"); the split itself is done here, on plain tensors:

    column-parallel (q, k, v, gate, up)            row-parallel (o, down)
    W [out, in]: rank r keeps rows                 W [out, in]: rank r keeps columns
      [r·out/N, (r+1)·out/N)                         [r·in/N, (r+1)·in/N)
    y_r = x · W_rᵀ   (its own heads/columns)       y = Σ_r x_r · W_rᵀ   (all_reduce, then the bias once)

q_proj's rows are head-major (head h owns rows [h·head_dim, (h+1)·head_dim)), so when N divides
the query heads and the KV heads, rank r holds query heads [r·H/N, (r+1)·H/N) and exactly the KV
heads they read, [r·KV/N, (r+1)·KV/N): attention needs no communication, and each rank's KV pool
holds only its own KV heads. Embeddings, norms and lm_head stay whole on every rank.

Why not transformers' `from_pretrained(tp_plan="auto")`: checked with transformers 5.24 on CPU/gloo,
it loads SmolLM2's GGUF and runs our attention correctly, but (1) its column split accepts widths
that do not divide (the last rank gets a shorter slice, cutting a head in two) where we must refuse,
(2) its parameters become DTensors swapped for local tensors on every call, and (3) its all_reduce
runs inside transformers, where its time cannot be measured per step. The plan is reused; the
execution is ~100 lines of ours.
"""
from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import dataclass, field

import msgpack
import torch
import torch.distributed as dist

from data_plane import sampler

COLWISE, ROWWISE = "colwise", "rowwise"


class TensorParallelError(ValueError):
    """A tensor-parallel size or architecture this model cannot be split by."""


@dataclass
class Comm:
    """This rank's place in the group, and the time it spent communicating, by kind."""
    rank: int
    world_size: int
    group: object = None        # all_reduce of activations (nccl on CUDA, gloo on CPU)
    cpu_group: object = None    # step plans and sampled tokens (always gloo: bytes live on the CPU)
    seconds: dict[str, float] = field(default_factory=lambda: {"all_reduce": 0.0, "plan": 0.0, "tokens": 0.0})

    def timed(self, kind: str, started: float) -> None:
        self.seconds[kind] += time.perf_counter() - started


def head_counts(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, config.intermediate_size


def check_size(config, tp_size: int) -> None:
    """Refuses a size that does not divide the query heads, the KV heads and the MLP width."""
    heads, kv_heads, inter = head_counts(config)
    if heads % tp_size or kv_heads % tp_size or inter % tp_size:
        common = math.gcd(math.gcd(heads, kv_heads), inter)
        sizes = [n for n in range(1, common + 1) if common % n == 0]
        raise TensorParallelError(
            f"--tensor-parallel-size {tp_size} does not divide this model ({heads} query heads, {kv_heads} KV "
            f"heads, MLP width {inter}): each rank must hold whole heads; choose one of "
            f"{', '.join(map(str, sizes))}")
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if tp_size > 1 and not plan:
        raise TensorParallelError(f"{type(config).__name__} has no tensor-parallel plan in transformers; "
                                  "run it with --tensor-parallel-size 1")
    unsupported = sorted({style for style in plan.values() if style not in (COLWISE, ROWWISE)})
    if tp_size > 1 and unsupported:
        raise TensorParallelError(f"{type(config).__name__}'s tensor-parallel plan uses {', '.join(unsupported)}, "
                                  "which pagedserve does not split; run it with --tensor-parallel-size 1")


def _matching(base_model: torch.nn.Module, plan: dict[str, str]):
    """(module, style) for every linear layer the plan names; '*' in a pattern is a layer number."""
    for name, module in base_model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                yield name, module, style
                break


def _keep(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.nn.Parameter:
    size = tensor.shape[dim] // world_size
    return torch.nn.Parameter(tensor.narrow(dim, rank * size, size).clone(), requires_grad=False)


def shard_model(model, comm: Comm) -> int:
    """Cuts every planned linear layer of `model` down to this rank's share, in place; returns how many."""
    check_size(model.config, comm.world_size)
    base = model.base_model
    count = 0
    for name, linear, style in list(_matching(base, model.config.base_model_tp_plan)):
        if not isinstance(linear, torch.nn.Linear):
            raise TensorParallelError(f"{name} is a {type(linear).__name__}, not a linear layer")
        if style == COLWISE:
            linear.weight = _keep(linear.weight.data, 0, comm.rank, comm.world_size)
            if linear.bias is not None:
                linear.bias = _keep(linear.bias.data, 0, comm.rank, comm.world_size)
            linear.out_features = linear.weight.shape[0]
        else:
            linear.weight = _keep(linear.weight.data, 1, comm.rank, comm.world_size)
            linear.in_features = linear.weight.shape[1]
            bias, linear.bias = linear.bias, None   # added once, after the sum
            linear.register_forward_hook(_reduce_hook(comm, bias))
        count += 1
    return count


def _reduce_hook(comm: Comm, bias):
    def hook(module, inputs, output):
        started = time.perf_counter()
        dist.all_reduce(output, group=comm.group)
        comm.timed("all_reduce", started)
        return output if bias is None else output + bias
    return hook


def send_bytes(comm: Comm, data: bytes, kind: str = "plan") -> None:
    """Rank 0: one frame to every other rank. The length goes by all_reduce, which every rank must
    join, so a rank that has died fails it on all the others; an empty frame is a heartbeat."""
    started = time.perf_counter()
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=comm.cpu_group)
    if data:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=comm.cpu_group)
    comm.timed(kind, started)


def recv_bytes(comm: Comm, kind: str = "plan") -> bytes:
    """Ranks 1..N-1: the next frame rank 0 sends (b"" for a heartbeat)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=comm.cpu_group)
    if not size.item():
        return b""
    started = time.perf_counter()   # waiting for rank 0 is idle time, not communication
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=comm.cpu_group)
    comm.timed(kind, started)
    return buf.numpy().tobytes()


def follow_sampling(comm: Comm):
    """The runner's `sample` for rank `comm.rank`: rank 0 samples and sends the token ids; the
    others take them, so that every rank appends the same tokens to its sequences (an unseeded
    draw differs from process to process). Log-probabilities are rank 0's alone: only it answers."""
    def sample(logits: torch.Tensor, rows: list[sampler.SampleRow]) -> list[list[sampler.SampleOutput]]:
        if comm.rank == 0:
            outputs = sampler.sample(logits, rows)
            send_bytes(comm, msgpack.packb([[o.token_id for o in draws] for draws in outputs]), "tokens")
            return outputs
        token_ids = msgpack.unpackb(recv_bytes(comm, "tokens"))
        return [[sampler.SampleOutput(t, 0.0, []) for t in draws] for draws in token_ids]
    return sample
