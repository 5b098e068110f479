"""Where pagedserve's bfloat16 tokens part from transformers' bfloat16 `generate`, and why.

    python bench/bf16_agreement.py                      # exp64's first 16 requests
    python bench/bf16_agreement.py --requests 16 --explain 4,0
    python bench/bf16_agreement.py --workload sharegpt    # the throughput bench's sharegpt trace, 64 requests

The data plane's runner in this process, played by tests/control_loop.py (no HTTP, no ZeroMQ), on the
throughput bench's 64-request trace (exp64 or sharegpt, its defaults), greedy:
1. tokens to the first divergence from transformers' greedy `generate` (one request at a time), with the
   runner given one request at a time and all 64 at once: whether batching changes a request's tokens;
2. for each request of --explain: the prompt through the lean forward and through transformers, layer by
   layer, up to the first layer whose output differs bit for bit; then that layer's operations, each given
   transformers' own inputs, to show which of them differs (products, attention, norms, SiLU).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402
from throughput import VOCAB_SIZE, exp64_trace, first_divergence, reference  # noqa: E402


def differs(name: str, ours, theirs) -> None:
    rows = (ours != theirs).reshape(ours.shape[0], -1).any(-1).nonzero().flatten().tolist()
    print(f"    {name:<16} {'equal' if not rows else f'differs in rows {rows[:6]}'}"
          + (f", largest difference {(ours.float() - theirs.float()).abs().max().item():.3g}" if rows else ""))


def explain(runner, hf, prompt: list[int]) -> None:
    """The first layer of the prompt whose output differs, then which of its operations does."""
    import torch

    from data_plane.attention import StepContext
    from ops import attention as attention_ops
    from ops import linear as linear_ops
    lean, cfg = runner.lean, hf.config
    P, bs = len(prompt), runner.block_size
    blocks, ids = -(-P // bs), torch.tensor(prompt)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    lens, starts = torch.tensor([P], dtype=torch.int32), torch.tensor([0, P], dtype=torch.int32)
    rows = attention_ops.kernel_rows(starts, lens, tables)   # the prompt's rows for the attention kernel
    every = lean.layers
    # the prompt's rows as the runner hands them to the products (StepContext.own_calls): one call of P rows
    own = linear_ops.OwnCalls([(0, P, P, 0)], P) if P > linear_ops.TILE_CALL_ROWS else None

    def lean_through(n: int) -> torch.Tensor:
        """Layer n's input norm of the residual after the first n layers, by the lean forward."""
        pool = torch.zeros(cfg.num_hidden_layers, 2, blocks, bs, cfg.num_key_value_heads,
                           cfg.hidden_size // cfg.num_attention_heads, dtype=torch.bfloat16)
        ctx = StepContext(pool, torch.arange(P, dtype=torch.int64), tables, lens, starts, P, backend=runner.backend,
                          kernel_rows=rows, own_calls=own)
        # the first n layers alone, one call each: the kernel's layers in one call (CodedLayers) run them all
        coded, lean.coded_layers, lean.layers = lean.coded_layers, None, every[:n]
        try:
            return lean(ids, torch.arange(P), ctx)
        finally:
            lean.layers, lean.coded_layers = every, coded

    with torch.inference_mode():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states
        first = next((n for n in range(cfg.num_hidden_layers)
                      if not torch.equal(lean_through(n + 1), hf.model.layers[n + 1].input_layernorm(hidden[n + 1])[0]
                                         if n + 1 < cfg.num_hidden_layers else hidden[n + 1][0])), None)
        if first is None:
            print("  every layer's output equals transformers', bit for bit")
            return
        print(f"  layer {first} is the first whose output differs; its operations on transformers' inputs:")
        layer, theirs = lean.layers[first], hf.model.layers[first]
        seen: dict = {}
        hooks = [theirs.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0][0].clone()))]
        for name, module in (("q", theirs.self_attn.q_proj), ("k", theirs.self_attn.k_proj),
                             ("v", theirs.self_attn.v_proj), ("o", theirs.self_attn.o_proj),
                             ("post_norm", theirs.post_attention_layernorm), ("gate", theirs.mlp.gate_proj),
                             ("up", theirs.mlp.up_proj), ("down", theirs.mlp.down_proj)):
            hooks.append(module.register_forward_hook(
                lambda m, a, out, name=name: seen.update({name: out[0].clone(), name + " in": a[0][0].clone()})))
        hf(ids[None])
        for h in hooks:
            h.remove()
        qkv = torch.cat([seen["q"], seen["k"], seen["v"]], -1).contiguous()
        differs("q, k, v", layer.qkv(seen["q in"].contiguous(), own=own), qkv)
        # the attention from transformers' own q, k and v: rotary, the cache write, the kernel's rows
        cos, sin = lean.rotary.cos_sin(seen["q in"], torch.arange(P))
        k_cache = torch.zeros(blocks, bs, layer.num_kv_heads, layer.head_dim, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        q = lean.kernel.rotary_store(qkv, layer.num_heads, layer.num_kv_heads, cos, sin, k_cache, v_cache,
                                     torch.arange(P))
        out = torch.empty_like(q)
        lean.kernel.paged_decode(out, q, k_cache, v_cache, rows.tables, rows.lens, rows.tokens, layer.scaling, 0, 0.0,
                                 None, None, 0, rows.ends, lean.sdpa_lanes, rows.qrows if lean.mkl_order else None)
        differs("attention", out.view(P, -1), seen["o in"])
        differs("o", layer.o(seen["o in"].contiguous(), own=own), seen["o"])
        residual = seen["in"].clone()
        differs("add, norm", lean.ops.add_rms_norm(residual, seen["o"].contiguous(), *lean.post_norms[first]),
                seen["post_norm"])
        gate_up = torch.cat([seen["gate"], seen["up"]], -1).contiguous()
        differs("gate, up", layer.gate_up(seen["post_norm"].contiguous(), own=own), gate_up)
        differs("SiLU(gate) up", lean.ops.silu_mul(gate_up), seen["down in"])
        differs("down", layer.down(seen["down in"].contiguous(), own=own), seen["down"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("exp64", "sharegpt"), default="exp64")
    ap.add_argument("--requests", type=int, default=16, help="the trace's first this many requests")
    ap.add_argument("--explain", default="", help="requests (indices) whose first difference to look into")
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    print(C.machine_line(args.num_threads))
    # as bench/throughput.py makes them with its defaults (seed 0, prompts up to 256, outputs up to 512 tokens)
    trace = exp64_trace(64, 0) if args.workload == "exp64" else \
        C.make_trace(64, 0, VOCAB_SIZE, args.workload, (C.PROMPT_RANGE[0], 256), (C.OUTPUT_RANGE[0], 512))
    hf = C.load_hf_model(args.num_threads, device="cpu").to(torch.bfloat16)
    ref = reference(hf, trace[:args.requests])
    runner = C.default_runner(args.num_threads, "inproc://bf16-agreement", "bfloat16")
    from shared.config import ControlPlaneConfig as cp   # the class attributes are the server's defaults
    from tests.control_loop import play

    def served(requests):   # greedy, no log-prob asked for, with the server's step budget and batch size
        return play(runner, [list(r.prompt_ids) for r in requests], [r.output_len for r in requests],
                    budget=cp.max_num_batched_tokens, max_num_seqs=cp.max_num_seqs, logprobs=None).outputs

    alone = [served([r])[0] for r in trace[:args.requests]]
    together = served(trace)[:args.requests]
    total = sum(len(tokens) for tokens, _ in ref)
    for name, outs in (("one request at a time", alone), ("all 64 at once", together)):
        firsts = [first_divergence(o, t) for o, (t, _) in zip(outs, ref)]
        same = sum(o == t for o, (t, _) in zip(outs, ref))
        print(f"{name}: tokens to the first divergence {sum(firsts)}/{total}, requests identical "
              f"{same}/{args.requests}; per request {firsts}")
    for index in (int(i) for i in args.explain.split(",") if i):
        print(f"request {index} ({len(trace[index].prompt_ids)} prompt tokens), its prompt:")
        explain(runner, hf, list(trace[index].prompt_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
