"""Engine overhead: the step time of pagedserve's real step loop against the bare model forward of
the same tokens.

    python bench/overhead.py            # decode batches of 1, 8, 32, 64 at a context of ~128, a 512-token prefill
    python bench/overhead.py --quick    # CI-sized

Three measurements of each step, all in this run (bare and runner alternate step by step):
  engine  `Engine.step()` of the real control plane against a data-plane subprocess over ZeroMQ:
          schedule (the plan included) + msgpack + ZeroMQ + input preparation + paged forward + sampling
          + applying the result (detokenizer, stop checks, metrics);
  bare    transformers' own forward of the same tokens with a DynamicCache (SDPA over a contiguous
          cache) plus an argmax: no engine;
  runner  the data plane's ModelRunner.execute in this process (no ZeroMQ, no control plane), to
          split the data plane's time into input preparation, forward and lm_head + sampling.
Decode sequences are prefilled through the engine first, so their context is 128 plus the steps
the prefill of the whole batch took (up to ~16 at 64 x 128); bare and runner use a context of 128.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict

os.environ.setdefault("TQDM_DISABLE", "1")   # the GGUF loader's progress bars would swamp the output
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

GOAL_RATIO = 1.15
VOCAB_SIZE = 49152


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=128, help="prompt length of the decode sequences")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill step (0: none)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per batch (prefill: repeats)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, context 32, prefill 64, 3 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.context, args.prefill, args.steps, args.warmup = "1,4", 32, 64, 3, 1
    args.batches = [int(b) for b in args.batches.split(",") if b]
    return args


def step_names(args) -> list[tuple[str, int, int]]:
    """(label, sequences, tokens) of every measured step kind."""
    names = [(f"decode {b} x ctx {args.context}", b, b) for b in args.batches]
    if args.prefill:
        names.append((f"prefill 1 x {args.prefill}", 1, args.prefill))
    return names


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(C.FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(n)]


def plan_seqs(plan) -> list:
    """The sequences a StepPlan scheduled, new and cached."""
    return plan.new_seqs + plan.cached_seqs


def num_batched_tokens(plan) -> int:
    """Tokens a StepPlan scheduled."""
    return sum(s.num_new_tokens for s in plan_seqs(plan))


def ms(seconds_list) -> float:
    return 1000 * C.mean(list(seconds_list))


# --- engine: the real step loop against a data-plane subprocess ----------------------------
class Probe:
    """Wraps, at run time and in this process only, the pieces `Engine.step()` calls, to time them."""

    def __init__(self, engine):
        import shared.protocol as P
        self.parts: dict[str, float] = defaultdict(float)
        self.last_out = None
        wrap = self._wrap
        engine.scheduler.schedule = wrap("schedule", engine.scheduler.schedule, keep=True)
        P.encode = wrap("msgpack", P.encode)
        P.decode = wrap("msgpack", P.decode)
        step = engine.client.step

        async def timed_step(plan, timeout):
            t = time.perf_counter()
            result = await step(plan, timeout)
            self.parts["round trip"] += time.perf_counter() - t
            self.parts["dp plan apply"] += result.swap_seconds
            self.parts["dp prepare+fwd+sample"] += result.forward_seconds
            return result
        engine.client.step = timed_step

    def _wrap(self, name, fn, keep=False):
        def timed(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            self.parts[name] += time.perf_counter() - t
            if keep:
                self.last_out = out
            return out
        return timed

    def take(self) -> dict[str, float]:
        parts, self.parts = dict(self.parts), defaultdict(float)
        return parts


async def measure_engine(args, address: str, tokenizer, rng) -> dict[str, dict]:
    from control_plane.dp_client import DataPlaneClient
    from control_plane.engine import Engine
    from control_plane.sampling_params import SamplingParams
    from shared.config import ControlPlaneConfig, default_model_path
    # each step's round trip whole: with overlap the engine would await the step before the one it sent
    cp = ControlPlaneConfig(model=default_model_path(), data_plane=address, max_num_batched_tokens=max(512, args.prefill),
                            async_scheduling=False).validate()
    client = DataPlaneClient(address)
    engine = Engine(cp, client, await client.handshake(600), tokenizer)
    probe = Probe(engine)
    results = {}

    async def timed_steps(n: int, expect_tokens: int) -> tuple[list[float], dict]:
        times = []
        probe.take()
        for _ in range(n):
            t = time.perf_counter()
            await engine.step()
            times.append(time.perf_counter() - t)
            got = num_batched_tokens(probe.last_out)
            assert got == expect_tokens, f"a measured step computed {got} tokens, expected {expect_tokens}"
        return times, probe.take()

    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)   # aborted once measured
    for label, num_seqs, num_tokens in step_names(args):
        C.progress(f"engine: {label}")
        if label.startswith("decode"):
            reqs = [engine.add_request(uuid.uuid4().hex, rand_ids(rng, args.context), params)
                    for _ in range(num_seqs)]
            for _ in range(10_000):   # prefill (in chunks, mixed with early decodes) until all sequences decode
                await engine.step()
                out = probe.last_out
                if len(plan_seqs(out)) == num_seqs and num_batched_tokens(out) == num_seqs:
                    break
            else:
                raise RuntimeError(f"{label}: the engine never scheduled all {num_seqs} sequences in one step")
            await timed_steps(args.warmup, num_tokens)
            times, parts = await timed_steps(args.steps, num_tokens)
            for r in reqs:
                engine.abort(r)
        else:
            once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            times, parts = [], defaultdict(float)
            for k in range(args.warmup + args.steps):   # a new prompt each time: no prefix-cache hit
                engine.add_request(uuid.uuid4().hex, rand_ids(rng, args.prefill), once)
                t, p = await timed_steps(1, num_tokens)
                if k >= args.warmup:
                    times += t
                    for key, v in p.items():
                        parts[key] += v
        results[label] = {"times": times, "parts": {k: v / len(times) for k, v in parts.items()}}
    C.progress_done()
    await client.shutdown()
    client.close()
    return results


# --- bare: transformers' forward with a DynamicCache ----------------------------------------
def bare_steps(model, args, rng, label: str, num_seqs: int):
    """A function that runs one timed bare step of this kind and returns its seconds."""
    import torch
    from transformers import DynamicCache
    if label.startswith("decode"):
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([rand_ids(rng, args.context) for _ in range(num_seqs)])
        with torch.inference_mode():
            state = {"next": model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)}

        @torch.inference_mode()
        def step() -> float:
            t = time.perf_counter()
            logits = model(input_ids=state["next"][:, None], cache=cache).logits
            state["next"] = logits[:, -1].argmax(-1)
            return time.perf_counter() - t
        return step

    @torch.inference_mode()
    def prefill_step() -> float:
        ids = torch.tensor([rand_ids(rng, args.prefill)])
        t = time.perf_counter()
        logits = model(input_ids=ids, cache=DynamicCache(config=model.config), logits_to_keep=1).logits
        logits[:, -1].argmax(-1)
        return time.perf_counter() - t
    return prefill_step


# --- runner: the data plane's ModelRunner in this process -----------------------------------
class RunnerSteps:
    """The data plane's ModelRunner in this process, one timed step at a time, split into parts."""

    def __init__(self, model, args, device: str = "cpu", dtype: str = "float32"):
        import torch
        from data_plane import attention
        from data_plane.model_runner import ModelRunner
        from shared.config import add_data_plane_args, add_model_args, data_plane_config
        # the runner's steps must run on the paged cache: a model loaded with SDPA would attend over
        # the step's own tokens only (measure_bare_and_runner switches back and forth per step)
        model.set_attn_implementation(attention.register())
        self.args, self.bs = args, 16
        self.per = -(-(args.context + 2 * (args.warmup + args.steps) + 2) // self.bs)   # blocks of one sequence
        num_blocks = max(max(args.batches) * self.per, -(-args.prefill // self.bs)) + 1
        # the data plane's own argument parser gives every setting its default, whatever settings exist
        parser = argparse.ArgumentParser()
        add_model_args(parser)
        add_data_plane_args(parser)
        ns = parser.parse_args(["--block-size", str(self.bs), "--kv-cache-blocks", str(num_blocks), "--dtype", dtype])
        if hasattr(ns, "swap_space_gib"):
            ns.swap_space_gib = 0.0   # no swapping here: no CPU pool to allocate
        self.runner = ModelRunner(model, data_plane_config(ns, "inproc://bench"), torch.device(device))
        self.parts: dict[str, float] = defaultdict(float)
        self.runner._forward = self._timed("forward", self.runner._forward)
        self.runner._prepare = self._timed("prepare", self.runner._prepare)
        self.seq_ids = iter(range(1, 1 << 30))
        self.step_id = 0

    def _timed(self, part: str, fn):
        def run(*a):
            t = time.perf_counter()
            out = fn(*a)
            self.parts[part] += time.perf_counter() - t
            return out
        return run

    def steps(self, rng, label: str, num_seqs: int):
        """A function that runs one step of this kind and returns its parts in seconds."""
        from shared.protocol import CachedSequence, NewSequence, SamplingSpec, StepPlan
        args, bs, per, runner = self.args, self.bs, self.per, self.runner
        decode = label.startswith("decode")
        # decode: each sequence arrives with context + 1 tokens, context of them already computed (their KV
        # values are whatever the pool holds: the cost is the same); sequence i owns blocks i*per ..
        known = args.context + 1 if decode else args.prefill
        tables = [list(range(i * per, i * per + -(-known // bs))) for i in range(num_seqs)]
        # as the control plane asks for a served greedy request without logprobs (-1: no log-prob wanted),
        # so that the step takes the same head (ops/greedy_head.py) as a served one
        greedy = SamplingSpec(temperature=0.0, logprobs=-1)
        new: list = []

        def step() -> dict[str, float]:
            nonlocal new
            self.step_id += 1
            if not new or not decode:   # new sequences (prefill: a new prompt each time), the old ones forgotten
                new = [NewSequence(next(self.seq_ids), rand_ids(rng, known), known - 1 if decode else known,
                                   known - 1 if decode else 0, 1 if decode else known, list(table),
                                   greedy) for table in tables]
                plan = StepPlan(self.step_id, new_seqs=new, forget_seq_ids=list(runner.seqs))
            else:   # one more token each, and a new block for a sequence whose last block is full
                cont = []
                for i, s in enumerate(new):
                    table = runner.seqs[s.seq_id].block_ids
                    grow = runner.seqs[s.seq_id].num_computed_tokens + 1 > len(table) * bs
                    cont.append(CachedSequence(s.seq_id, 1, [i * per + len(table)] if grow else []))
                plan = StepPlan(self.step_id, cached_seqs=cont)
            self.parts.clear()
            result = runner.execute(plan)
            return {"execute": result.forward_seconds + result.swap_seconds, "prepare": self.parts["prepare"],
                    "forward": self.parts["forward"],
                    "lm_head+sample": result.forward_seconds - self.parts["prepare"] - self.parts["forward"]}
        return step


def measure_bare_and_runner(model, args, rng) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Bare and runner steps of each kind alternate, so that a change in machine load hits both alike."""
    from data_plane import attention
    runner = RunnerSteps(model, args)
    bare, parts = {}, {}
    for label, num_seqs, _ in step_names(args):
        C.progress(f"bare forward and runner, alternating: {label}")
        model.set_attn_implementation("sdpa")
        bare_step = bare_steps(model, args, rng, label, num_seqs)
        model.set_attn_implementation(attention.register())
        runner_step = runner.steps(rng, label, num_seqs)
        times, totals = [], defaultdict(float)
        for k in range(args.warmup + args.steps):
            model.set_attn_implementation("sdpa")
            with C.plain_linears(model):    # torch's own linear layers, not the runner's few-row kernel
                t = bare_step()
            model.set_attn_implementation(attention.ATTENTION_NAME)
            p = runner_step()
            if k >= args.warmup:
                times.append(t)
                for key, v in p.items():
                    totals[key] += v
        bare[label] = times
        parts[label] = {k: v / args.steps for k, v in totals.items()}
    C.progress_done()
    return bare, parts


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    print(C.machine_line(args.num_threads))
    print(C.cpu_check(args.num_threads))
    print("model: SmolLM2-135M-Instruct, float32, greedy; engine, bare and runner measured one after another")
    address = f"ipc://{tempfile.gettempdir()}/pagedserve-bench-{uuid.uuid4().hex[:12]}.sock"
    from shared.config import default_model_path
    log = tempfile.NamedTemporaryFile("w", prefix="pagedserve-bench-dp-", suffix=".log", delete=False)
    # the data plane loads its model while this process loads its own and the tokenizer
    dp = subprocess.Popen([sys.executable, "-m", "data_plane", "--model", default_model_path(), "--listen", address,
                           "--num-threads", str(args.num_threads), "--metrics-port", "0"],
                          cwd=C.ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        model = C.load_hf_model(args.num_threads, device="cpu")   # its runner below is on CPU too
        from control_plane.launch import load_tokenizer
        tokenizer = load_tokenizer(default_model_path())
        C.Timer.note("waiting for the data plane; then engine steps")
        engine = asyncio.run(measure_engine(args, address, tokenizer, rng))
    finally:
        try:
            dp.wait(timeout=30)   # told to shut down by measure_engine
        except subprocess.TimeoutExpired:
            dp.kill()
            dp.wait()
        log.close()
        if os.path.exists(address.removeprefix("ipc://")):
            os.unlink(address.removeprefix("ipc://"))
        if dp.returncode == 0:
            os.unlink(log.name)
        else:
            print(f"the data plane exited with {dp.returncode}; its log: {log.name}", file=sys.stderr)
    C.Timer.note("bare forward and in-process runner, alternating step by step")
    bare, runner = measure_bare_and_runner(model, args, rng)

    # engine / bare measured directly compares phases minutes apart (load drifts on a shared machine);
    # the paired ratio multiplies two ratios each measured within the same steps or alternating steps:
    # engine step / the data plane's own time in those steps, and runner / bare, alternating.
    print(f"\n{'step':<24} {'tokens':>6} {'bare fwd ms':>11} {'engine step ms':>14} {'direct':>7} "
          f"{'engine/dp':>9} {'runner/bare':>11} {'paired':>7}  goal <= {GOAL_RATIO} (paired)")
    for label, _, tokens in step_names(args):
        b, e = ms(bare[label]), ms(engine[label]["times"])
        p = engine[label]["parts"]
        dp_ms = 1000 * (p.get("dp plan apply", 0) + p.get("dp prepare+fwd+sample", 0))
        engine_dp, runner_bare = e / dp_ms, 1000 * runner[label]["execute"] / b
        paired = engine_dp * runner_bare
        print(f"{label:<24} {tokens:>6} {b:>11.1f} {e:>14.1f} {e / b:>7.2f} {engine_dp:>9.3f} {runner_bare:>11.2f} "
              f"{paired:>7.2f}  {'met' if paired <= GOAL_RATIO else 'not met'}")
    cols = ["schedule", "msgpack", "zmq+remote", "dp plan apply", "dp prepare+fwd+sample",
            "apply+metrics"]
    print("\nengine step breakdown, ms per step (msgpack: encode plan + decode result here; zmq+remote: round trip "
          "less msgpack here less the data plane's own timings; apply+metrics: the rest of Engine.step)")
    print(f"{'step':<24} " + " ".join(f"{c:>{max(10, len(c))}}" for c in cols))
    for label, _, _ in step_names(args):
        p = engine[label]["parts"]
        step = ms(engine[label]["times"])
        dp_time = 1000 * (p.get("dp plan apply", 0) + p.get("dp prepare+fwd+sample", 0))
        values = {k: 1000 * p.get(k, 0) for k in ("schedule", "msgpack", "dp plan apply",
                                                   "dp prepare+fwd+sample")}
        values["zmq+remote"] = 1000 * (p.get("round trip", 0) - p.get("msgpack", 0)) - dp_time
        values["apply+metrics"] = step - 1000 * (p.get("schedule", 0) + p.get("round trip", 0))
        print(f"{label:<24} " + " ".join(f"{values[c]:>{max(10, len(c))}.2f}" for c in cols))
    print("\ndata plane in this process (ModelRunner.execute, no ZeroMQ), ms per step")
    print(f"{'step':<24} {'execute':>8} {'prepare':>8} {'forward':>8} {'lm_head+sample':>14} {'exec/bare':>9}")
    for label, _, _ in step_names(args):
        r = {k: 1000 * v for k, v in runner[label].items()}
        print(f"{label:<24} {r['execute']:>8.1f} {r['prepare']:>8.2f} {r['forward']:>8.1f} "
              f"{r['lm_head+sample']:>14.2f} {r['execute'] / ms(bare[label]):>9.2f}")
    print(f"benchmark wall time: {time.monotonic() - C.Timer.start:.0f} s (model loads included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
