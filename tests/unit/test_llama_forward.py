"""data_plane/llama_forward.py: the lean Llama forward gives transformers' numbers, step by step."""
import sys

import pytest
import torch

from data_plane import llama_forward
from ops import attention as attention_ops
from ops import linear as linear_ops
from tests.helpers import make_runner, paged_model, play_steps


def test_lean_forward_samples_what_transformers_forward_samples():
    prompts = [[5, 9, 23, 7, 81, 6, 44, 3, 17, 99, 12], [8, 41, 2, 60], [77] * 13]
    lean_runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4)
    hf_runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4, lean_forward=False)
    assert lean_runner.lean is not None and hf_runner.lean is None
    lean, hf = play_steps(lean_runner, prompts, steps=12), play_steps(hf_runner, prompts, steps=12)
    assert len(lean) == len(hf) == 3 * 13
    assert [(s, t) for s, t, _, _ in lean] == [(s, t) for s, t, _, _ in hf]
    for (_, _, lp_a, top_a), (_, _, lp_b, top_b) in zip(lean, hf):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert [p for _, p in top_a] == pytest.approx([p for _, p in top_b], abs=1e-5)


def test_stacked_weights_are_the_models_own_and_keep_its_forward():
    model = paged_model(seed=4)
    ids = torch.tensor([[5, 9, 23, 7]])
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        before = model(ids).logits
    attn = model.model.layers[0].self_attn
    q_before = attn.q_proj.weight.detach().clone()
    forward = llama_forward.LlamaForward(model)
    stacked = forward.layers[0].qkv.weight
    assert attn.q_proj.weight.data_ptr() == stacked.data_ptr()          # a view: no copy kept beside it
    assert attn.k_proj.weight.data_ptr() == stacked[attn.q_proj.weight.shape[0]:].data_ptr()
    assert torch.equal(attn.q_proj.weight, q_before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("change, reason", [
    (dict(attention_bias=True), "biased"),
    (dict(mlp_bias=True), "biased"),
    (dict(hidden_act="gelu"), "activation"),
])
def test_models_it_does_not_cover_keep_transformers_forward(change, reason):
    from transformers import LlamaForCausalLM

    from data_plane import attention
    from tests.helpers import tiny_llama_config
    config = tiny_llama_config()
    for key, value in change.items():
        setattr(config, key, value)
    config._attn_implementation = attention.register()
    model = LlamaForCausalLM(config).eval()
    assert reason in llama_forward.unsupported_reason(model)
    assert make_runner(model, swap_blocks=4).lean is None


def test_bfloat16_lean_forward_samples_what_transformers_bfloat16_forward_samples():
    # the same attention op and the same GEMM bits on both sides; the norms, rotary and SiLU in
    # transformers' order and types: the lean forward changes nothing but the number of calls
    prompts = [[5, 9, 23, 7, 81, 6, 44, 3, 17, 99, 12], [8, 41, 2, 60], [77] * 13]
    lean_runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4, dtype="bfloat16")
    hf_runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4, lean_forward=False, dtype="bfloat16")
    assert lean_runner.lean is not None and lean_runner.pool.dtype == torch.bfloat16
    lean, hf = play_steps(lean_runner, prompts, steps=12), play_steps(hf_runner, prompts, steps=12)
    assert [(s, t) for s, t, _, _ in lean] == [(s, t) for s, t, _, _ in hf]
    for (_, _, lp_a, top_a), (_, _, lp_b, top_b) in zip(lean, hf):
        assert lp_a == pytest.approx(lp_b, abs=2e-2)


def test_bfloat16_lean_forward_gives_transformers_bfloat16_logits():
    from data_plane.attention import StepContext
    model = paged_model(seed=6).to(torch.bfloat16)
    reference = paged_model(seed=6).to(torch.bfloat16)
    reference.set_attn_implementation("sdpa")
    lean = llama_forward.LlamaForward(model)
    qkv = lean.layers[0].qkv
    assert qkv.dot is not None or qkv.packed is not None or qkv.tiles is not None or qkv.dots \
        or not torch.backends.mkldnn.is_available()
    cfg = model.config
    ids = torch.tensor([3, 17, 99, 4, 250, 7, 31, 64])
    pool = torch.zeros(cfg.num_hidden_layers, 2, 4, 4, cfg.num_key_value_heads,
                       cfg.hidden_size // cfg.num_attention_heads, dtype=torch.bfloat16)
    ctx = StepContext(pool, torch.arange(8, dtype=torch.int64), torch.tensor([[0, 1]], dtype=torch.int32),
                      torch.tensor([8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8)
    with torch.inference_mode():
        got = model.get_output_embeddings()(lean(ids, torch.arange(8), ctx))
        expected = reference(ids[None]).logits[0]
    assert got.dtype == expected.dtype == torch.bfloat16
    if attention_ops.torch_sdpa_lanes(torch.bfloat16):
        # the paged attention in torch's SDPA order, the products in oneDNN's: transformers' logits, bit for bit
        assert torch.equal(got, expected)
    else:
        # (SDPA's own vectors here are ones the kernel does not follow: its probabilities are rounded to
        # bfloat16, the kernel's are not; a few bfloat16 steps apart at most, and the same argmax)
        assert (got.float() - expected.float()).abs().max() < 0.05 * expected.float().abs().max()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bfloat16_decode_step_gives_transformers_bfloat16_logits():
    # transformers computes a generated token in a call of one row, whose products past 1024 inputs (the
    # MLP's down projection here, 1280 inputs) oneDNN sums in other chunks than a call of many rows: the
    # step marks those rows (StepContext.one_row) and the products follow
    from data_plane.attention import StepContext
    model = paged_model(seed=7, hidden=640, heads=10, kv_heads=5).to(torch.bfloat16)
    reference = paged_model(seed=7, hidden=640, heads=10, kv_heads=5).to(torch.bfloat16)
    reference.set_attn_implementation("sdpa")
    lean = llama_forward.LlamaForward(model)
    cfg = model.config
    assert cfg.intermediate_size > 1024
    # a prompt of more rows than oneDNN sums in one accumulator on AMX tiles (StepContext.own_calls)
    prompt = [3, 17, 99, 4, 250, 7, 31, 64] * 5
    follows = [12, 400, 77, 5, 301, 42, 9, 260]
    pool = torch.zeros(cfg.num_hidden_layers, 2, 12, 4, cfg.num_key_value_heads, 64, dtype=torch.bfloat16)
    table, prompt_lens = torch.arange(12, dtype=torch.int32)[None], torch.tensor([40], dtype=torch.int32)

    def step(ids, first, one_row):
        positions = torch.arange(first, first + len(ids))
        lens, starts = torch.tensor([first + len(ids)], dtype=torch.int32), torch.tensor([0, len(ids)], dtype=torch.int32)
        ctx = StepContext(pool, positions.clone(), table, lens, starts, len(ids),
                          kernel_rows=attention_ops.kernel_rows(starts, lens, table, prompt_lens=prompt_lens),
                          one_row=torch.full((len(ids),), one_row),
                          own_calls=None if one_row else linear_ops.OwnCalls([(0, len(ids), len(ids), 0)], len(ids)))
        return model.get_output_embeddings()(lean(torch.tensor(ids), positions, ctx))

    with torch.inference_mode():
        step(prompt, 0, False)
        got = [step([token], 40 + k, True) for k, token in enumerate(follows)]
        cache = reference(torch.tensor([prompt]), use_cache=True).past_key_values
        expected = [reference(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0] for token in follows]
    down = lean.layers[0].down
    if (down.dot is not None or down.tiles is not None) and lean.mkl_order:
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    else:   # (other CPUs: oneDNN's own kernels, or SDPA's vectors the kernel does not follow)
        assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, expected))


def _one_row_flags(dtype: str, prompts, steps: int) -> list:
    """StepContext.one_row of each step the runner's lean forward runs (as lists; None where unset)."""
    runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4, dtype=dtype)
    lean, seen = runner.lean, []

    class Spy:
        def __getattr__(self, name):
            return getattr(lean, name)

        def __call__(self, ids, positions, ctx):
            seen.append(None if ctx.one_row is None else ctx.one_row.tolist())
            return lean(ids, positions, ctx)

    runner.lean = Spy()
    play_steps(runner, prompts, steps=steps, chunk=5)
    return seen


def test_the_runner_marks_the_tokens_transformers_computes_alone():
    # a prompt's tokens are one call of many rows in transformers, even in chunks; a one-token prompt and
    # every generated token a call of one row (StepContext.one_row, for the bfloat16 products' chunks)
    prompts = [[5, 9, 23, 7, 81, 6, 44, 3, 17, 99, 12], [8], [41, 2, 60, 7]]
    no, yes = False, True
    assert _one_row_flags("bfloat16", prompts, steps=2) == [
        [no] * 5 + [yes] + [no] * 4,   # chunks of 5: of 11 tokens, 1, 4
        [no] * 5, [no],                 # the first prompt's second and third chunks
        [yes] * 3, [yes] * 3]           # two decode steps
    # float32's products sum alike for every row count: no flags
    assert _one_row_flags("float32", prompts, steps=1) == [None] * 4


def test_the_runner_marks_the_prompts_transformers_computes_in_calls_of_many_rows():
    # a prompt longer than TILE_CALL_ROWS is one call of that many rows in transformers: its rows, and a chunk's
    # at their places in that call (StepContext.own_calls, for the AMX tiles' route); bfloat16 only
    assert linear_ops.TILE_CALL_ROWS == 32
    prompts = [list(range(3, 43)), [8], list(range(50, 84))]   # 40, 1 and 34 tokens
    runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4, dtype="bfloat16")
    lean, seen = runner.lean, []

    class Spy:
        def __getattr__(self, name):
            return getattr(lean, name)

        def __call__(self, ids, positions, ctx):
            seen.append(None if ctx.own_calls is None else (ctx.own_calls.ranges, ctx.own_calls.total))
            return lean(ids, positions, ctx)

    runner.lean = Spy()
    play_steps(runner, prompts, steps=1, chunk=30)
    assert seen == [([(0, 30, 40, 0), (31, 61, 34, 0)], 61),   # 30 of the first, the second's one, 30 of the third
                    ([(0, 10, 40, 30), (10, 14, 34, 30)], 14),  # the rest of both (the second decodes in the next)
                    None]                                        # a decode step
    seen.clear()
    runner = make_runner(paged_model(seed=3), num_blocks=64, swap_blocks=4, dtype="float32")
    lean = runner.lean
    runner.lean = Spy()
    play_steps(runner, prompts, steps=0, chunk=30)
    assert seen == [None, None]   # float32's products sum alike in every call


def test_bfloat16_tokens_and_logprobs_do_not_depend_on_the_batch():
    # prompts in chunks beside other prompts and decodes, against each request alone with its prompt in one step:
    # every row takes the bits of transformers' call for it whatever the step holds (on AMX tiles the prompts'
    # rows their call's order, StepContext.own_calls; elsewhere the kernels sum each row alike in every call)
    prompts = [list(range(3, 43)), [8, 9, 10], list(range(50, 84)), list(range(90, 150))]

    def run(group, chunk):
        runner = make_runner(paged_model(seed=5, hidden=640, heads=10, kv_heads=5), num_blocks=64, swap_blocks=4,
                             dtype="bfloat16")
        return play_steps(runner, group, steps=4, chunk=chunk)

    together = run(prompts, chunk=24)
    for i, prompt in enumerate(prompts):
        alone = [(t, lp, top) for _, t, lp, top in run([prompt], chunk=len(prompt))]
        assert [(t, lp, top) for seq, t, lp, top in together if seq == i] == alone


def test_a_long_prompts_last_rows_alone_in_a_step_take_its_calls_order():
    # a GGUF model in bfloat16 reads its codes for steps of a few rows, in the order of a call of one row; the last
    # rows of a prompt longer than TILE_CALL_ROWS, alone in a step, still take the prompt's call's order
    from tests.helpers import gguf_form_model
    prompt = list(range(3, 43))

    def run(chunk):
        # (a seed whose last rows' products differ between the two orders on the AMX machine, seen failing there
        # before the forward took the tiles' route for them)
        model = gguf_form_model(paged_model(seed=9, hidden=640, heads=10, kv_heads=5, layers=4))
        runner = make_runner(model, num_blocks=64, swap_blocks=4, dtype="bfloat16", narrowed_by_runner=True)
        return [(t, lp, top) for _, t, lp, top in play_steps(runner, [prompt], steps=3, chunk=chunk)], runner

    (alone, runner), (tail, _) = run(40), run(36)   # the prompt in one step; in 36 rows, then 4
    qkv = runner.lean.layers[0].qkv
    assert qkv.codes_route(1) is not None or not qkv.kernel.has_coded_simd()   # a few rows read the codes
    assert tail == alone


def test_another_architecture_keeps_transformers_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert "not LlamaForCausalLM" in llama_forward.unsupported_reason(model)


def test_a_tensor_parallel_shard_keeps_transformers_forward():
    """A rank holds half the heads and all-reduces in forward hooks: the lean forward would read the
    whole model's head counts from the config and skip the hooks."""
    from data_plane import tensor_parallel
    model = paged_model(seed=1)
    assert llama_forward.unsupported_reason(model) is None
    tensor_parallel.shard_model(model, tensor_parallel.Comm(0, 2))
    assert "tensor-parallel shard" in llama_forward.unsupported_reason(model)


def test_fused_kernels_give_torch_operations_numbers():
    from data_plane.attention import StepContext
    from ops import cpu_kernels
    if cpu_kernels.load() is None:
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.failure()}")
    model = paged_model(seed=5)
    fused, plain = llama_forward.LlamaForward(model), llama_forward.LlamaForward(model, fused=False)
    assert type(fused.ops).__name__ == "_KernelOps" and type(plain.ops).__name__ == "_TorchOps"
    cfg = model.config
    pool = torch.zeros(cfg.num_hidden_layers, 2, 8, 4, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    ids = torch.tensor([3, 17, 99, 4, 250, 7])
    ctx = StepContext(pool, torch.arange(6, dtype=torch.int64), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                      torch.tensor([4, 2], dtype=torch.int32), torch.tensor([0, 4, 6], dtype=torch.int32), 4)
    positions = torch.tensor([0, 1, 2, 3, 0, 1])
    with torch.inference_mode():
        expected = plain(ids, positions, ctx)
        got = fused(ids, positions, ctx)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    assert not torch.equal(got, torch.zeros_like(got))


def test_bfloat16_gguf_model_is_narrowed_by_the_runner_and_reads_its_codes():
    # load_model hands a GGUF model over in float32 when it is served in bfloat16: the runner finds the
    # codes, narrows the model, and reads the codes for few rows; the tokens are those of the same
    # bfloat16 model on oneDNN's GEMM alone
    from data_plane.model_runner import ModelRunner
    from ops import cpu_kernels
    from shared.config import DataPlaneConfig
    from tests.helpers import gguf_form_model
    if cpu_kernels.load() is None:
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.failure()}")
    prompts = [[5, 9, 23, 7, 81, 6, 44, 3, 17, 99, 12], [8, 41, 2, 60], [77] * 13]
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=4, kv_cache_blocks=64, swap_blocks=4,
                             dtype="bfloat16")
    coded = ModelRunner(gguf_form_model(paged_model(seed=3)), config, torch.device("cpu"))
    assert coded.model.dtype == torch.bfloat16 and coded.lean is not None
    head = coded.model.get_output_embeddings().forward
    dots = linear_ops.bf16_dots_kernel(cpu_kernels.load())
    if dots:
        # AVX2 alone: every product in the order of torch's own GEMM, F.linear's there; the layers' Q4_1
        # codes and the output layer's Q8_0 ones read in that order for few rows
        assert all(lin.dots and lin.codes is None and lin.dots_codes is not None for lin in coded.lean.linears())
        assert head.dots and head.dots_codes is not None and head.dots_codes[0].dtype == torch.int8
    else:
        assert all(lin.codes is not None for lin in coded.lean.linears())
        assert head.codes.kind == "q8_0"
    plain = make_runner(gguf_form_model(paged_model(seed=3)), num_blocks=64, swap_blocks=4, dtype="bfloat16")
    assert all(lin.codes is None for lin in plain.lean.linears())
    with_codes, without = play_steps(coded, prompts, steps=12), play_steps(plain, prompts, steps=12)
    assert [(s, t) for s, t, _, _ in with_codes] == [(s, t) for s, t, _, _ in without]
    for (_, _, lp_a, _), (_, _, lp_b, _) in zip(with_codes, without):
        # (in torch's order the codes give the bfloat16 weights' very bits)
        assert lp_a == (lp_b if dots else pytest.approx(lp_b, abs=2e-2))


def _coded_runner(seed: int, dtype: str):
    """A runner over a model whose every product is GGUF codes: in float32, or handed over in float32 and
    narrowed by the runner to bfloat16 (as a GGUF served with --dtype bfloat16), so that it keeps the codes."""
    from data_plane.model_runner import ModelRunner
    from shared.config import DataPlaneConfig
    from tests.helpers import gguf_form_model
    model = gguf_form_model(paged_model(seed=seed))
    if dtype == "float32":
        return make_runner(model, num_blocks=64, swap_blocks=4)
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=4, kv_cache_blocks=64, swap_blocks=4,
                             dtype=dtype)
    return ModelRunner(model, config, torch.device("cpu"))


def _kernel_for(dtype: str, monkeypatch):
    """The CPU kernels (the test fails without them); "bfloat16 in torch's own order" takes the routes of a CPU
    with AVX2 alone on any CPU, as if oneDNN had no bfloat16 GEMM for it."""
    from ops import cpu_kernels
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.failure()}")
    if dtype.startswith("bfloat16 "):
        monkeypatch.setattr(linear_ops, "has_packed_bf16_gemm", lambda: False)
    return kernel


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 in torch's own order"])
def test_layers_in_one_call_give_the_python_loops_bits(dtype, monkeypatch):
    # a model whose every product reads codes runs its layers in one call to the kernel module (CodedLayers):
    # the same kernels in the same order as the Python loop, so every logit the same bits. float32 at every
    # row count; bfloat16 up to the rows its products read codes, and above those where the kernel's own
    # bfloat16 product is every product's route (AVX512-BF16's, AMX tiles', not oneDNN's GEMM). The third case takes the
    # routes of a CPU with AVX2 alone (bf16_dots_codes_linear, bf16_dots_linear) on any CPU, as if oneDNN had
    # no bfloat16 GEMM for it
    kernel = _kernel_for(dtype, monkeypatch)
    if dtype.startswith("bfloat16 "):
        assert linear_ops.bf16_dots_kernel(kernel) == kernel.vectorized()
        dtype = "bfloat16"
    prompts = [[5, 9, 23, 7, 81, 6, 44, 3, 17, 99, 12], [8], [41, 2, 60, 7]]
    one_call, loop = _coded_runner(6, dtype), _coded_runner(6, dtype)
    assert one_call.model.dtype == getattr(torch, dtype)
    # the codes are every product's route where the kernel is vectorized (AVX-512, or AVX2 and F16C)
    assert (one_call.lean.coded_layers is not None) == kernel.has_coded_simd()
    dots = linear_ops.bf16_dots_kernel(kernel)
    if dtype == "bfloat16" and kernel.has_coded_simd():
        wide = {lin.wide_route()[0] if lin.wide_route() else None for lin in one_call.lean.linears()}
        assert wide == ({"bf16_dots_linear"} if dots else
                        {"bf16_linear"} if linear_ops.bf16_dot_kernel(kernel) else
                        {"amx_codes_linear" if kernel.has_amx_codes_linear() else "amx_linear"}
                        if linear_ops.amx_tiles(kernel) else {None})
        assert one_call.lean.coded_rows == (sys.maxsize if wide != {None} else linear_ops.BF16_CODES_MAX_ROWS)
        kernels = {lin.codes_route(1)[0] for lin in one_call.lean.linears()}
        assert kernels == {"bf16_dots_codes_linear" if dots else "coded_pairs_linear"}
    loop.lean.coded_layers = None
    calls, kept = [], []
    if one_call.lean.coded_layers is not None:
        layers = one_call.lean.coded_layers

        class Counted:
            def set_caches(self, caches):
                layers.set_caches(caches)

            def forward(self, *args):
                calls.append(args[0].shape[0])
                kept.append(None if args[-1] is None else args[-1].tolist())
                return layers.forward(*args)

        one_call.lean.coded_layers = Counted()
    got, expected = play_steps(one_call, prompts, steps=6, chunk=5), play_steps(loop, prompts, steps=6, chunk=5)
    assert len(got) == len(expected) == 3 * 7
    assert got == expected      # tokens, log-probs and top log-probs, exactly
    if kernel.has_coded_simd():
        assert len(calls) >= 6 and 3 in calls     # the decode steps of three rows took the one call
        # also the first step's prompt chunks (5 + 1 + 4 rows), unless bfloat16's products of more rows than
        # the codes serve are oneDNN's: those steps took the Python loop
        every_count = one_call.lean.coded_rows == sys.maxsize
        assert max(calls) <= one_call.lean.coded_rows and (10 in calls) == every_count
        assert every_count == (dtype == "float32" or linear_ops.bf16_dot_kernel(kernel) or dots
                               or linear_ops.amx_tiles(kernel))
        # the first step's last layer ran past its attention for the two prompts it finished only (rows 5
        # and 9 of 10: the third prompt's chunk of 5 of 11 tokens samples nothing); decode steps keep all
        assert all(keep is None for rows, keep in zip(calls, kept) if rows == 3)
        assert ([5, 9] in kept) == every_count
    with torch.inference_mode():
        assert torch.equal(one_call.pool, loop.pool)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 in torch's own order", "float32 loop"])
def test_prompt_rows_that_sample_nothing_skip_the_last_layer_with_the_same_bits(dtype, monkeypatch):
    # a prompt step's rows that sample nothing stop after the last layer's attention (their KV written) where
    # its products give a row the same bits in a call of fewer rows; the sampled rows' tokens, log-probs and
    # the pool are those of the step that computes every row to the end
    kernel = _kernel_for(dtype, monkeypatch)
    kind = dtype.split()[0]
    prompts = [[5, 9, 23, 7, 81, 6, 44, 3, 17, 99, 12, 30, 31], [8], [41, 2, 60, 7]]
    skipping, full = _coded_runner(6, kind), _coded_runner(6, kind)
    full.skip_unsampled = False
    if dtype.endswith(" loop"):
        skipping.lean.coded_layers = full.lean.coded_layers = None   # the Python loop of the layers
    last = skipping.lean.layers[-1]
    apart = all(lin.rows_apart for lin in (last.o, last.gate_up, last.down))
    # float32: the codes' kernel at every row count; bfloat16: where the many-row route is the kernel's own
    # product too (not oneDNN's GEMM, as on a CPU with AMX tiles)
    assert apart == (kernel.has_coded_simd() if kind == "float32"
                     else linear_ops.bf16_dot_kernel(kernel) or linear_ops.bf16_dots_kernel(kernel))
    rows = []
    real = skipping.lean._routes

    def routes(count):
        rows.append(count)
        return real(count)
    monkeypatch.setattr(skipping.lean, "_routes", routes)
    got, expected = play_steps(skipping, prompts, steps=4, chunk=6), play_steps(full, prompts, steps=4, chunk=6)
    assert got == expected      # tokens, log-probs and top log-probs, exactly
    with torch.inference_mode():
        assert torch.equal(skipping.pool, full.pool)
    if apart and (skipping.lean.coded_layers is None or skipping.lean.coded_rows < 11):
        # the Python loop's last layer took the two finished prompts' rows alone in the first step (13 + 1 + 4
        # tokens in chunks of 6: 6 + 1 + 4 rows); in bfloat16 the one call serves only a few rows where the
        # products of more are oneDNN's
        assert 2 in rows, rows
