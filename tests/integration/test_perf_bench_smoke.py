"""The performance benchmarks run end to end on CI-sized inputs (`--quick`) and print what they promise.

Each loads SmolLM2 twice (a served data plane and an in-process transformers model, in parallel),
so each takes about a minute on 2 idle cores. One torch thread per process: on a busy machine,
two OpenMP threads per process can run many times slower than one (see _common.cpu_check).
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(name: str, *extra: str) -> str:
    cmd = [sys.executable, os.path.join("bench", name), "--quick", "--num-threads", "1", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    return done.stdout


def number_after(pattern: str, text: str) -> float:
    match = re.search(pattern + r"\s*([0-9.]+)", text)
    assert match, f"no {pattern!r} in:\n{text}"
    return float(match.group(1))


@pytest.mark.slow
def test_throughput_quick():
    # pagedserve and the transformers baselines; the anchors (v, l) are set up by their scripts, not CI,
    # and their absence is tested below: a machine that has them would spend minutes on them here
    out = run_bench("throughput.py", "--dtypes", "float32", "--systems", "abc", "--rounds", "2")
    for system in ("(a) pagedserve", "(b) transformers generate", "(c) transformers continuous batching"):
        assert system in out, out
    assert number_after(r"\(a\) pagedserve, REST API, all requests at once\s+float32\s+[0-9.]+", out) > 0
    assert number_after(r"ratio \(a\)/\(b\) float32:", out) > 0
    # (c) either ran and has a ratio, or the output says why it could not run
    assert "ratio (a)/(c) float32:" in out or re.search(r"\(c\) transformers continuous batching.* not run:", out), out
    # greedy float32 on prompts of equal length (no padding): the same tokens as transformers
    assert "token check (a) vs (b) float32: 0 of 8 requests differ" in out, out
    assert "cpu check" in out and "machine:" in out
    # --rounds 2: (a) served twice, both rounds' figures printed, the second round's tokens the first's
    assert re.search(r"^  \(a\) float32\s+[0-9.]+\s+[0-9.]+$", out, re.M), out
    assert "round 2: every system's tokens identical to its own in round 1" in out, out


@pytest.mark.slow
def test_throughput_sampled_quick():
    """--sampling: the served requests sample, each round reports its rate, and no token check is made
    where every system draws its own tokens."""
    out = run_bench("throughput.py", "--dtypes", "float32", "--systems", "a", "--sampling", "--rounds", "2")
    assert "sampled {'temperature': 0.7, 'top_p': 0.9" in out, out
    assert re.search(r"^  \(a\) float32\s+[0-9.]+\s+[0-9.]+$", out, re.M), out
    assert "token check: none (--sampling" in out and "identical to its own" not in out, out
    with pytest.raises(SystemExit, match="served systems only"):
        throughput_module().main(["--quick", "--sampling", "--systems", "ab"])


@pytest.mark.slow
def test_throughput_quick_on_another_model(tmp_path):
    """--model: a folder of plain float weights (bench/random_model.py), served by pagedserve and checked
    against transformers on the same folder; llama-server, which runs the default GGUF only, says so."""
    folder = str(tmp_path / "model")
    made = subprocess.run([sys.executable, os.path.join("bench", "random_model.py"), folder, "--hidden-size", "128",
                           "--layers", "2", "--intermediate-size", "256", "--heads", "4", "--kv-heads", "2",
                           "--dtype", "float32"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and "wrote" in made.stdout, made.stdout + made.stderr[-3000:]
    out = run_bench("throughput.py", "--dtypes", "float32", "--systems", "abl", "--model", folder)
    assert f"model: {folder}," in out, out
    assert number_after(r"ratio \(a\)/\(b\) float32:", out) > 0
    assert "token check (a) vs (b) float32: 0 of 8 requests differ" in out, out
    assert re.search(r"\(l\) llama.cpp.*not run: --model without --llama-gguf: no GGUF of that model", out), out


def throughput_module():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import throughput
    finally:
        sys.path.pop(0)
    return throughput


def test_throughput_arguments():
    parse = throughput_module().parse_args
    args = parse(["--dtypes", "float32,bfloat16", "--llama-np", "8,16", "--systems", "av"])
    assert args.dtypes == ["float32", "bfloat16"] and args.llama_np == [8, 16] and args.systems == "av"
    assert parse(["--dtype", "bfloat16"]).dtypes == ["bfloat16"]
    single = parse(["--single"])
    assert single.single and (single.single_prompt_len, single.single_output_len) == (57, 133)
    for bad in (["--dtypes", "float32,int8"], ["--systems", "ax"], ["--llama-np", "0"], ["--rounds", "0"],
                ["--rounds", "2", "--single"], ["--model", "/nonexistent"],
                ["--llama-gguf", __file__]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_throughput_rounds_report(capsys):
    """--rounds: the ratio of each round is taken within the round and the goal judged on their median; a
    later round whose tokens differ from the first's is named."""
    T = throughput_module()
    args = T.parse_args(["--systems", "avl", "--dtypes", "float32", "--rounds", "3"])
    trace = [T.C.TraceRequest([1, 2], 2, 0), T.C.TraceRequest([3], 2, 0)]
    same, other = [[5, 6], [7, 8]], [[5, 6], [7, 9]]

    def round_of(a, v, l, l_tokens=same):   # seconds of (a), (v) (None: it failed), (l)
        run = {("a", "float32"): T.Run(a, same), ("l", T.LLAMA): T.Run(l, l_tokens)}
        return run if v is None else {**run, ("v", "float32"): T.Run(v, same)}
    # (a)/(v) per round: 1.4, 1.8, none (median 1.6: met); (a)/(l): 2.0, 3.5, 2.5 (median 2.5: not met)
    rounds = [round_of(1.0, 1.4, 2.0), round_of(1.0, 1.8, 3.5), round_of(2.0, None, 5.0, other)]
    T.report_rounds(args, trace, rounds, [{}, {}, {("v", "float32"): "RuntimeError: gone"}])
    out = capsys.readouterr().out
    assert "ratio (a)/(v) float32, round by round: 1.40 1.80; median 1.60  (goal >= 1.5: met)" in out, out
    assert "ratio (a)/(l) float32, round by round: 2.00 3.50 2.50; median 2.50" in out and "not met" in out, out
    assert "  (a) float32       4.0     4.0     2.0" in out and "  (v) float32       2.9     2.2       -" in out, out
    assert "round 3: (l) gguf: 1 of 2 requests' tokens differ from round 1's (request 1 at token 1/2)" in out, out
    assert "round 3: (v) float32 not run: RuntimeError: gone" in out, out
    assert "identical to its own" not in out, out


@pytest.mark.parametrize("mode", [[], ["--single"]])
def test_throughput_absent_anchors(mode):
    """Anchors that are not set up are reported with the script that sets them up; the run does not fail."""
    env = {**os.environ, "PAGEDSERVE_VLLM_VENV": "/nonexistent", "PAGEDSERVE_LLAMACPP_DIR": "/nonexistent"}
    cmd = [sys.executable, os.path.join("bench", "throughput.py"), "--quick", "--num-threads", "1",
           "--systems", "vl", "--dtypes", "float32,bfloat16", *mode]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    for dtype in ("float32", "bfloat16"):
        assert re.search(rf"\(v\) vLLM CPU build.*{dtype}\s+not run: .*run bench/vllm_setup.sh", done.stdout), done.stdout
    assert re.search(r"\(l\) llama.cpp.*not run: .*run bench/llamacpp_setup.sh", done.stdout), done.stdout


@pytest.mark.slow
def test_overhead_quick():
    out = run_bench("overhead.py")
    for label in ("decode 1 x ctx 32", "decode 4 x ctx 32", "prefill 1 x 64"):
        rows = [line for line in out.splitlines() if line.startswith(label)]
        assert len(rows) == 3, f"{label}: expected a ratio, a breakdown and a runner row in:\n{out}"
        cells = [row[len(label):].split() for row in rows]
        bare_ms, engine_ms, ratio = (float(x) for x in cells[0][1:4])
        assert bare_ms > 0 and engine_ms > 0 and ratio > 0, rows[0]
        breakdown = [float(x) for x in cells[1]]
        assert len(breakdown) == 6 and breakdown[4] > 0, rows[1]   # the data plane's forward took time
    assert "goal <= 1.15" in out


def test_cpu_kernels_quick():
    out = run_bench("cpu_kernels.py")
    attention, linear = out.split("every linear layer")
    # one attention row: a speedup and a small output difference
    rows = re.findall(r"^\s*\d+\s+\d+\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)x\s+([0-9.e+-]+)$", attention, re.M)
    assert len(rows) == 1, out
    # two linear rows: the few-row kernel and the packed GEMM, each against F.linear
    cells = [line.split() for line in linear.splitlines() if re.match(r"^\s*\d+\s+[0-9.]", line)]
    assert len(cells) == 2 and all(len(c) == 11 for c in cells), out
    for c in cells:
        rows += [(c[5].rstrip("x"), c[6]), (c[9].rstrip("x"), c[10])]
    for speedup, diff in rows:
        assert float(speedup) > 0 and float(diff) < 1e-3, out


def test_layers_one_call_bench():
    # a few steps each way: both columns measured, and a row count the one call does not take said so (on a CPU
    # whose bfloat16 products of more rows are the kernel's own, it takes every count: then 9 rows are measured too)
    cmd = [sys.executable, os.path.join("bench", "layers_one_call.py"), "--rows", "1,9", "--rounds", "1", "--block", "2",
           "--num-threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    assert "bfloat16: the one call takes up to" in done.stdout
    one_row = [line.split() for line in done.stdout.splitlines() if line.startswith("1 ")]
    assert len(one_row) == 1 and float(one_row[0][1]) > 0 and float(one_row[0][2]) > 0, done.stdout
    nine = [line.split() for line in done.stdout.splitlines() if line.startswith("9 ")]
    assert len(nine) == 1, done.stdout
    if "the one call takes up to any number of rows" in done.stdout:
        assert float(nine[0][1]) > 0 and float(nine[0][2]) > 0, done.stdout
    else:
        assert re.search(r"^9 .*not run: more rows than the one call takes", done.stdout, re.M), done.stdout


def test_prompt_attention_bench():
    # one prompt length, both dtypes timed through both paths; where the kernel follows torch's SDPA order,
    # every bfloat16 value of a 120-token prompt, whole and in two runs, is transformers'
    cmd = [sys.executable, os.path.join("bench", "prompt_attention.py"), "--lengths", "120", "--repeats", "2",
           "--num-threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("120 ")]
    assert [row[1] for row in rows] == ["float32", "bfloat16"], done.stdout
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows), done.stdout
    bits = " ".join(rows[1][5:])
    counts = re.findall(r"(\d+)/(\d+)", bits)
    if "not checked" not in bits:
        assert len(counts) == 2 and all(a == b for a, b in counts), done.stdout


def test_stream_cost_bench():
    # one short stream: the client's time per token, the data plane's steps (from its own /metrics: one per
    # token, the prompt's included) and the threads of both planes, the data plane's main thread among them
    cmd = [sys.executable, os.path.join("bench", "stream_cost.py"), "--dtypes", "float32", "--tokens", "20",
           "--repeats", "2", "--num-threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    out = done.stdout
    assert number_after(r"\n  token", out) > 0
    steps = re.search(r"; (\d+) steps for (\d+) tokens", out)
    assert steps and int(steps.group(2)) == 40 and int(steps.group(1)) >= 40, out
    assert number_after(r"\n  steps", out) > 0 and number_after(r"of which the forward pass and sampling", out) > 0
    threads = dict(re.findall(r"^  (control plane: \S+|data plane: \S+)\s+([0-9.]+)", out, re.M))
    assert "data plane: main" in threads and "control plane: main" in threads, out
    assert float(threads["data plane: main"]) > 0, out
