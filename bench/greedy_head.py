"""The output layer of a greedy step: the full product through the layer's route and the argmax of its logits
(greedy_logsumexp, as rows that ask for log-probs take it) against the greedy head (ops/greedy_head.py: an
int8 first pass and the exact logits of its candidates), on the final hidden states of the model decoding
the bench's kind of prompts (random ordinary tokens, as bench/throughput.py's traces), alternating in one
process; both must give the same tokens (and, in float32, logits), bit for bit.

    python bench/greedy_head.py                 # SmolLM2's Q8_0 codes, float32; rows 1, 4, 16, 64, 128; median of 9,
                                                # each repeat the pool's next states
    python bench/greedy_head.py --dtype bfloat16
    python bench/greedy_head.py --model DIR     # a model of plain weights (bench/random_model.py writes one)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402


def hidden_states(model, num_prompts: int, steps: int, seed: int):
    """The final hidden state (after the last norm) of every decode step of greedy generation."""
    import torch
    rows = []
    for request in C.make_trace(num_prompts, seed, model.config.vocab_size, "sharegpt"):
        ids = torch.tensor([request.prompt_ids])
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_hidden_states=True,
                             return_dict_in_generate=True, pad_token_id=0)
        rows.extend(step[-1][0, -1] for step in out.hidden_states[1:])
    return torch.stack(rows).contiguous()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,128")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", metavar="DIR", help="a model folder (or GGUF file) instead of the default model")
    args = ap.parse_args(argv)
    import torch

    from ops import cpu_kernels, greedy_head, linear, quantized

    print(C.machine_line(args.num_threads))
    model = C.load_hf_model(args.num_threads, device="cpu", path=args.model and os.path.abspath(args.model))
    kernel = cpu_kernels.load()
    with torch.inference_mode():
        pool = hidden_states(model, 8, 24, seed=0)
    print(f"{pool.shape[0]} hidden states from 8 prompts of a sharegpt trace, 24 greedy steps each, {args.dtype}")
    dtype = getattr(torch, args.dtype)
    # the output layer alone, in the dtype, routed as the runner routes it: a bfloat16 weight with the codes of
    # the float32 one it was rounded from, where it has them
    weight = model.get_output_embeddings().weight.detach().float().contiguous()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    head.forward = linear.RoutedLinear(head.weight, None, kernel, True,
                                       codes=True if dtype == torch.float32 else quantized.find_codes(weight))
    greedy = greedy_head.build(head, kernel)
    if greedy is None:
        print("not run: no greedy head here (neither AVX512-VNNI nor AVX2 in this build, or the output layer's "
              "route has none: docs/architecture.md)")
        return 1
    print(f"output layer {tuple(weight.shape)}: {'codes' if greedy.codes is not None else 'plain weight, codes near it'}, "
          f"first pass {greedy.kind}, {greedy.nbytes / 2**20:.1f} MiB laid out; the greedy head serves from "
          f"{greedy.min_rows} rows")
    table = C.Table(["rows", "full ms", "greedy head ms", "ratio", "exact logits / row (mean, max)"])
    for rows in (int(r) for r in args.rows.split(",")):
        full_times, head_times, exact = [], [], []
        for repeat in range(args.repeats):
            # each repeat other states: how many candidates a row leaves varies by tens from one state to the next
            x = pool[(torch.arange(rows) + repeat * rows) % pool.shape[0]].to(dtype).contiguous()
            t0 = time.perf_counter()
            with torch.no_grad():
                best, index, _ = kernel.greedy_logsumexp(head(x))
            t1 = time.perf_counter()
            tokens, logits, counts = greedy.argmax(x)
            t2 = time.perf_counter()
            full_times.append(t1 - t0)
            head_times.append(t2 - t1)
            exact.extend(counts.tolist())
            same = torch.equal(tokens, index) and (dtype != torch.float32 or
                                                   torch.equal(logits.view(torch.int32), best.view(torch.int32)))
            if not same:
                print(f"MISMATCH at {rows} rows: the greedy head's tokens or logits differ from the full product's")
                return 1
        full, fast = statistics.median(full_times) * 1e3, statistics.median(head_times) * 1e3
        table.add(rows, f"{full:.2f}", f"{fast:.2f}", f"{fast / full:.2f}x",
                  f"{statistics.mean(exact):.1f}, {max(exact)}")
    print(table.render())
    print("tokens" + (" and logits" if dtype == torch.float32 else "") + " equal bit for bit at every row count")
    return 0


if __name__ == "__main__":
    sys.exit(main())
