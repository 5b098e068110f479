"""data_plane/model_support.py: the start-time probe refuses what would be served wrong, and the logits
path it picks equals the model's own (Granite's scaling, Gemma 2's final soft-cap)."""
from __future__ import annotations

import re

import pytest
import torch

from data_plane import __main__ as data_plane_main
from data_plane import attention, model_support, own_attention
from tests.architectures import REFUSED, SUPPORTED, build


def paged(name, **config_changes):
    model = build(SUPPORTED[name], attention.register())
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    return model


@pytest.mark.parametrize("name", ["Granite (logits_scaling)", "Gemma2 (caps, alternating window)", "Llama"])
def test_final_logits_equal_the_models_own(name):
    model = build(SUPPORTED[name], "eager")
    ids = torch.tensor([[1, 17, 230, 45, 9, 300]])
    with torch.inference_mode():
        own = model(input_ids=ids).logits[0]
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
        model.set_attn_implementation(attention.register())
        support = model_support.check_model(model)
        rows = torch.tensor([5, 2])
        got = support.final_logits(hidden.index_select(0, rows))
        plain = model.get_output_embeddings()(hidden.index_select(0, rows))
    torch.testing.assert_close(got, own.index_select(0, rows), atol=1e-5, rtol=1e-5)
    if name != "Llama":   # the model's own head must matter here, or this test proves nothing
        assert (plain - own.index_select(0, rows)).abs().max() > 0.1
        assert support.final_logits is not model.get_output_embeddings()
    else:   # a head that adds nothing is skipped: the output embeddings themselves
        assert support.final_logits is model.get_output_embeddings()


def test_probe_finds_windows_per_layer():
    support = model_support.check_model(paged("Gemma2 (caps, alternating window)"))
    assert support.layer_windows == [12, None, 12, None]
    assert model_support.check_model(paged("Qwen2 (use_sliding_window)")).layer_windows == [None, 16, 16]
    assert model_support.check_model(paged("Llama")).layer_windows == [None, None]


def test_a_model_that_computes_attention_itself_is_refused_by_the_probe(monkeypatch):
    # BLOOM computes attention in its own code; without its paged forward (data_plane/own_attention.py)
    # the probe sees that no layer calls the attention interface
    monkeypatch.setattr(own_attention, "FORWARDS", {})
    model = build(SUPPORTED["BLOOM (ALiBi)"], attention.register())
    with pytest.raises(model_support.UnsupportedModel, match="BloomForCausalLM .*attention interface"):
        model_support.check_model(model)


def test_a_window_the_layers_do_not_pass_is_refused():
    # the config now declares a window the layers (built with 16) do not use
    model = paged("Qwen2 (use_sliding_window)", sliding_window=24)
    with pytest.raises(model_support.UnsupportedModel, match="layer 1 passes sliding window 16 but its config "
                                                             "declares 24"):
        model_support.check_model(model)


def test_final_logits_that_cannot_be_reproduced_are_refused(monkeypatch):
    def broken(model, hidden):
        raise RuntimeError("no head")
    monkeypatch.setattr(model_support, "own_head_logits", broken)
    with pytest.raises(model_support.UnsupportedModel, match="final logits"):
        model_support.check_model(paged("Gemma2 (caps, alternating window)"))


def test_the_probe_uses_paged_attention_and_gives_back_the_models_own():
    # benchmarks hand the runner a model set to sdpa and switch it later: probed all the same
    model = build(SUPPORTED["Gemma2 (caps, alternating window)"], "eager")
    assert model_support.check_model(model).layer_windows == [12, None, 12, None]
    assert model.config._attn_implementation == "eager"
    with pytest.raises(model_support.UnsupportedModel, match="attention interface"):
        model_support.check_model(build(REFUSED["GPTNeoForCausalLM"][0], "eager"))


def test_the_data_plane_exits_non_zero_naming_the_architecture(tmp_path, capsys):
    build(REFUSED["GPTNeoForCausalLM"][0], "eager").save_pretrained(tmp_path)
    code = data_plane_main.main(["--model", str(tmp_path), "--listen", "inproc://refused", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert "GPTNeoForCausalLM is not supported by pagedserve" in err and "attention interface" in err


@pytest.mark.parametrize("extra,reason", [({"is_causal": False}, "not causal"),
                                          ({"alibi_slopes": torch.zeros(4)}, "['alibi_slopes']"),
                                          ({"s_aux": torch.zeros(3)}, "sinks have shape (3,)")])
def test_attention_arguments_pagedserve_does_not_implement_are_refused(extra, reason, monkeypatch):
    # a layer that hands the interface one more argument, or sinks (GPT-OSS's s_aux) not one per head
    model = paged("Llama")
    layer = model.model.layers[1].self_attn
    original = layer.forward
    monkeypatch.setattr(layer, "forward", lambda *a, **kw: original(*a, **{**kw, **extra}))
    with pytest.raises(model_support.UnsupportedModel, match=re.escape(reason)):
        model_support.check_model(model)


def test_chunked_layers_are_found_and_bound_what_blocks_can_be_freed():
    support = model_support.check_model(paged("Llama 4 text (chunks of 8, NoPE layer, MoE)"))
    assert support.layer_chunks == [8, 8, 8, None]
    assert support.freeable_window == 0   # its global layer reads every block
    # a chunk of C bounds a layer's reach as a window of C does: the widest reach is what may be freed
    logits = support.final_logits
    assert model_support.Support([None, 12], logits, [8, None]).freeable_window == 12
    assert model_support.Support([None, 4], logits, [8, None]).freeable_window == 8
    assert model_support.Support([None, None], logits, [8, None]).freeable_window == 0


def test_llama4_temperature_tuning_moves_to_paged_attention_while_it_runs():
    model = build(SUPPORTED["Llama 4 text (chunks of 8, NoPE layer, MoE)"], "eager")
    model_support.check_model(model)
    nope_layer = model.model.layers[3].self_attn
    assert not nope_layer.use_rope
    assert bool(nope_layer.attn_temperature_tuning)          # generate: transformers scales the queries
    with attention.record_calls():                           # a paged pass: our attention scales them
        assert not bool(nope_layer.attn_temperature_tuning)
    assert bool(nope_layer.attn_temperature_tuning)


def test_latent_attention_pools_k_wide_heads_and_refuses_v_wider_than_k():
    config, _ = SUPPORTED["DeepSeek-V2 (latent attention, K 24 wide, V 16)"]()
    assert model_support.head_dim(config) == 24 and not model_support.config_reasons(config)
    config.v_head_dim = 32
    assert any("V head size 32 is wider than K head size 24" in r for r in model_support.config_reasons(config))
