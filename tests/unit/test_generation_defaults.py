"""--generation-config: the model's own sampling settings fill in what a request leaves out (as in vLLM)."""
import json

import pytest

from control_plane import generation_defaults as G
from control_plane.sampling_params import parse_sampling
from shared import config as C


def _gguf(path, **sampling):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        name = f"general.sampling.{key}"
        if isinstance(value, int):
            w.add_int32(name, value)
        else:
            w.add_float32(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_request_gets_the_models_values_for_what_it_leaves_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "bos_token_id": 1}))
    defaults, where = G.load(str(tmp_path), "auto")
    assert defaults == {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert "generation_config.json" in where
    p = parse_sampling({}, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (0.6, 0.8, 20, 1.05, 0.0)
    p = parse_sampling({"temperature": 0, "top_k": -1}, defaults=defaults)   # the request's own win
    assert (p.temperature, p.top_k, p.top_p) == (0.0, -1, 0.8)
    assert G.load(str(tmp_path), "vllm")[0] == {}


def test_a_gguf_files_sampling_keys_are_read(tmp_path):
    path = _gguf(tmp_path / "m.Q8_0.gguf", temp=0.7, top_p=0.95, top_k=0, min_p=0.05, penalty_repeat=1.1)
    defaults, where = G.load(path, "auto")
    assert defaults["temperature"] == pytest.approx(0.7) and defaults["top_p"] == pytest.approx(0.95)
    assert defaults["top_k"] == -1      # llama.cpp's 0: no top-k
    assert defaults["min_p"] == pytest.approx(0.05) and defaults["repetition_penalty"] == pytest.approx(1.1)
    assert "general.sampling" in where


def test_sampling_keys_are_found_past_the_vocabulary_and_a_bad_file_is_refused(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "bb", "ccc"])            # arrays of strings and
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 1])                    # of numbers are stepped over
    w.add_string("general.name", "tiny")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_string("general.sampling.top_p", "high")                            # no request could send it
    w.add_uint32("general.sampling.top_k", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert G.load(str(tmp_path / "v.gguf"), "auto")[0] == {"temperature": 0.25, "top_k": -1}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(tmp_path / "v.gguf", "rb").read()[:60])             # cut inside the metadata
    with pytest.raises(C.ConfigError, match="not a GGUF file pagedserve can read"):
        G.load(str(bad), "auto")
    (tmp_path / "text.gguf").write_text("not gguf at all")
    with pytest.raises(C.ConfigError, match="no GGUF magic"):
        G.load(str(tmp_path / "text.gguf"), "auto")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(C.ConfigError, match="not a GGUF file"):
        G.load(str(tmp_path / "empty.gguf"), "auto")


def test_values_a_request_could_not_send_are_dropped(tmp_path):
    path = _gguf(tmp_path / "m.gguf", temp=7.0, top_p=0.9)
    assert G.load(path, "auto")[0] == {"top_p": pytest.approx(0.9)}
    assert G.load(_gguf(tmp_path / "plain.gguf"), "auto")[0] == {}


def test_the_default_model_is_greedy_unless_asked_and_says_why():
    cp = C.ControlPlaneConfig().validate()
    assert G.for_config(cp) == {"temperature": 0.0}
    assert "for the default model, whose GGUF file sets none" in G.describe(cp)
    assert parse_sampling({"temperature": 0.7}, defaults=G.for_config(cp)).temperature == 0.7
    cp.generation_config = "vllm"
    assert G.for_config(cp) == {} and "temperature=1.0" in G.describe(cp)


def test_a_folder_given_as_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    cp = C.ControlPlaneConfig(generation_config=str(tmp_path)).validate()
    assert G.for_config(cp) == {"temperature": 0.3}
    with pytest.raises(C.ConfigError, match="--generation-config"):
        C.ControlPlaneConfig(generation_config=str(tmp_path / "missing")).validate()
