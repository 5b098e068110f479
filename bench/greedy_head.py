"""The output layer of a greedy step in float32: the full Q8_0 product and the argmax of its logits
(coded_linear, then greedy_logsumexp, as rows that ask for log-probs take it) against the greedy head
(ops/greedy_head.py: an int8 first pass and the exact logits of its candidates), on the final hidden
states of SmolLM2 decoding the bench's kind of prompts (random ordinary tokens, as bench/throughput.py's
traces), alternating in one process; both must give the same tokens and logits, bit for bit.

    python bench/greedy_head.py                 # rows 1, 4, 16, 64, 128; median of 9
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
    args = ap.parse_args(argv)
    import torch

    from ops import cpu_kernels, greedy_head

    print(C.machine_line(args.num_threads))
    model = C.load_hf_model(args.num_threads, device="cpu")
    kernel = cpu_kernels.load()
    head = model.get_output_embeddings()
    greedy = greedy_head.build(head, kernel)
    if greedy is None:
        print("not run: no greedy head here (neither AVX512-VNNI nor AVX2 in this build, "
              "or the output layer is not Q8_0 codes)")
        return 1
    codes = greedy.codes
    with torch.inference_mode():
        pool = hidden_states(model, 8, 24, seed=0)
    print(f"{pool.shape[0]} hidden states from 8 prompts of a sharegpt trace, 24 greedy steps each")
    table = C.Table(["rows", "full ms", "greedy head ms", "ratio", "exact logits / row (mean, max)"])
    for rows in (int(r) for r in args.rows.split(",")):
        x = pool[torch.arange(rows) % pool.shape[0]].contiguous()
        full_times, head_times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            best, index, _ = kernel.greedy_logsumexp(kernel.coded_linear(x, codes.codes, codes.scales, None))
            t1 = time.perf_counter()
            tokens, logits, counts = kernel.q8_argmax(x, greedy.packed, codes.codes, codes.scales, greedy.absums,
                                                      greedy.norms, greedy.widest, None)
            t2 = time.perf_counter()
            full_times.append(t1 - t0)
            head_times.append(t2 - t1)
            if not (torch.equal(tokens, index) and torch.equal(logits.view(torch.int32), best.view(torch.int32))):
                print(f"MISMATCH at {rows} rows: the greedy head's tokens or logits differ from the full product's")
                return 1
        full, fast = statistics.median(full_times) * 1e3, statistics.median(head_times) * 1e3
        table.add(rows, f"{full:.2f}", f"{fast:.2f}", f"{fast / full:.2f}x",
                  f"{counts.float().mean():.1f}, {int(counts.max())}")
    print(table.render())
    print("tokens and logits equal bit for bit at every row count")
    return 0


if __name__ == "__main__":
    sys.exit(main())
