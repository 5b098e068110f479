"""The sampling and text fields beyond parse_sampling's: OpenAI's logit_bias and vLLM's extensions
(allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, truncate_prompt_tokens), checked and put on the SamplingParams."""
from __future__ import annotations

import re

from control_plane.sampling_params import SamplingParams, ValidationError, flag

MAX_LOGIT_BIAS_ENTRIES = 300   # OpenAI's limit
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_BAD_WORDS = 100


def _token_id(value, name: str, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValidationError(f"'{name}' holds {value!r}, not a token id in [0, {vocab_size})", name,
                              "invalid_token_id")
    return value


def parse_logit_bias(body: dict, vocab_size: int) -> list[tuple[int, float]]:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ValidationError("'logit_bias' must be an object of token id -> bias", "logit_bias", "invalid_type")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}",
                              "logit_bias")
    out = []
    for key, value in bias.items():
        if not re.fullmatch("[0-9]+", key):   # digits only: int() would also take " 5", "+5" and "5_0"
            raise ValidationError(f"'logit_bias' key {key!r} is not a token id", "logit_bias", "invalid_type")
        token = int(key)
        _token_id(token, "logit_bias", vocab_size)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValidationError(f"'logit_bias' of token {key} must be a number in [-100, 100]", "logit_bias")
        out.append((token, float(value)))
    return out


def bad_words_ids(words, tokenizer) -> list[list[int]]:
    """Each word as tokens, alone and after a space (a BPE tokenizer spells the two differently)."""
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words) or len(words) > MAX_BAD_WORDS:
        raise ValidationError(f"'bad_words' must be a list of up to {MAX_BAD_WORDS} non-empty strings", "bad_words",
                              "invalid_type")
    out: list[list[int]] = []
    for word in words:
        for spelling in (word, " " + word.lstrip()):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def apply_extensions(body: dict, params: SamplingParams, tokenizer, vocab_size: int) -> None:
    params.logit_bias = parse_logit_bias(body, vocab_size)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise ValidationError("'allowed_token_ids' must be a non-empty list of token ids", "allowed_token_ids",
                                  "invalid_type")
        params.allowed_token_ids = sorted({_token_id(t, "allowed_token_ids", vocab_size) for t in allowed})
    if body.get("bad_words") is not None:
        params.bad_words_ids = bad_words_ids(body["bad_words"], tokenizer)
    params.include_stop_str_in_output = flag(body, "include_stop_str_in_output")
    params.skip_special_tokens = body.get("skip_special_tokens", True) is not False
    flag(body, "skip_special_tokens")
    flag(body, "spaces_between_special_tokens")   # accepted: the tokenizer's own decoding decides spacing


def truncate_prompt_tokens(body: dict) -> int | None:
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError("'truncate_prompt_tokens' must be a positive integer", "truncate_prompt_tokens",
                              "invalid_type")
    return value
