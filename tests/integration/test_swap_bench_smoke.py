"""bench/swap.py runs end to end at CI size (`--quick`) and prints what it promises: SwapPool's
bandwidth next to a plain copy, and per preemption mode a server run whose /metrics counters say
the mode did what it is named for, with the same greedy tokens in every mode.

The servers serve the suite's tiny random Llama (seconds to start, where SmolLM2 takes ~30 s),
one thread each; three servers one after another keep this under about a minute on 2 cores."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def table_rows(output: str) -> dict[str, list[str]]:
    """Each table row (cells separated by 2+ spaces) by its first cell."""
    rows = {}
    for line in output.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 5:
            rows.setdefault(cells[0], cells)
    return rows


@pytest.mark.slow
def test_swap_bench_quick(tiny_model_dir, tmp_path):
    plot = tmp_path / "swap.png"
    cmd = [sys.executable, os.path.join("bench", "swap.py"), "--quick", "--num-threads", "1",
           "--model", tiny_model_dir, "--plot", str(plot)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    out = done.stdout
    rows = table_rows(out)

    # part 1: every size moved blocks at some rate, next to a copy of the same bytes
    assert "swap bandwidth: SwapPool on a pool of [30, 2, 64, 16, 3, 64] float32" in out, out
    for k in ("1", "8", "32"):
        cells = rows.get(k)
        assert cells is not None and len(cells) == 10, f"no bandwidth row for {k} blocks in:\n{out}"
        swap_out, copy_out, ratio_out, swap_in, copy_in, ratio_in = (float(cells[i]) for i in (3, 4, 5, 7, 8, 9))
        assert min(swap_out, copy_out, swap_in, copy_in) > 0, cells
        assert ratio_out == pytest.approx(swap_out / copy_out, abs=0.02), cells
        assert ratio_in == pytest.approx(swap_in / copy_in, abs=0.02), cells

    # part 2: each mode preempted the way it is named for, according to the server's own counters
    runs = {}
    for mode in ("auto", "swap", "recompute"):
        cells = rows.get(mode)
        assert cells is not None and len(cells) == 10, f"no row for {mode} in:\n{out}"
        tok_per_s, p50, p99 = float(cells[1]), float(cells[3]), float(cells[4])
        assert tok_per_s > 0 and 0 < p50 <= p99, cells
        runs[mode] = [int(c) for c in cells[5:9]]   # recompute, swap, blocks out, blocks in
    recompute, swap, blocks_out, blocks_in = runs["swap"]
    assert recompute == 0 and swap > 0 and blocks_out == blocks_in > 0, runs
    recompute, swap, blocks_out, blocks_in = runs["recompute"]
    assert recompute > 0 and swap == 0 and blocks_out == blocks_in == 0, runs
    assert sum(runs["auto"][:2]) > 0, runs          # the same pressure: auto preempted too, either way
    assert runs["auto"][2] == runs["auto"][3], runs  # whatever went out came back in

    # greedy float32: preemption, of either kind, never changes a token
    assert "greedy outputs identical across modes: yes" in out, out
    assert "cpu check" in out and "machine:" in out
    assert plot.exists() and plot.stat().st_size > 0
