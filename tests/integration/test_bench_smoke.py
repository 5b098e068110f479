"""The memory benchmarks run end to end on a small trace (`--quick`) and print what they promise:
sharing saves blocks (beam search far more than parallel sampling), the prefix cache is hit,
and paging wastes less KV memory and admits more requests than contiguous reservation."""
import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(name: str, tmp_path) -> str:
    cmd = [sys.executable, os.path.join("bench", name), "--quick"]
    if importlib.util.find_spec("matplotlib") is not None:   # the plot is optional; exercise it when we can
        cmd += ["--plot", str(tmp_path / name.replace(".py", ".png"))]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def row(output: str, name: str) -> list[str]:
    """The cells of the table row that starts with `name` (columns are separated by 2+ spaces)."""
    for line in output.splitlines():
        if line.startswith(name) and re.match(r"\s{2,}", line[len(name):]):
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row {name!r} in:\n{output}")


def percent(cell: str) -> float:
    return float(cell.rstrip("%"))


def test_sharing_bench_quick(tmp_path):
    out = run_bench("sharing.py", tmp_path)
    saving = {}
    for width in (2, 4, 6):
        for mode in (f"parallel n={width}", f"beam width {width}"):
            cells = row(out, mode)
            saving[mode] = percent(cells[1])
            assert cells[-1] == "0", f"{mode}: the roomy pool should never preempt"
        assert 0 < saving[f"parallel n={width}"] < saving[f"beam width {width}"]
    assert saving["beam width 4"] > 30
    off, on = row(out, "off"), row(out, "on")          # first match: the prefix-cache table
    assert percent(off[1]) == 0 and percent(on[1]) > 50
    assert int(on[2]) < int(off[2]) == int(off[3])      # computed fewer prompt tokens than it was given
    assert "mean TTFT" in out and "mean TTFT without the cache / with it" in out


def test_memory_bench_quick(tmp_path):
    out = run_bench("memory.py", tmp_path)
    paged = row(out, "paging (block size 16)")
    oracle = row(out, "reserve prompt + actual output (oracle)")
    capped = row(out, "reserve prompt + max_tokens (256)")
    maxlen = row(out, "reserve max model length (8192)")
    waste = [percent(r[1]) for r in (paged, oracle, capped, maxlen)]
    assert waste == sorted(waste) and waste[0] < 20 and waste[2] > 50, waste
    peak = [int(r[5]) for r in (paged, capped, maxlen)]
    assert peak[0] > peak[1] > peak[2] == 1, peak
