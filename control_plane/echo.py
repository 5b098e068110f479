"""Completions' `echo` with `max_tokens: 0` and no log-probs: the prompt alone, from the tokenizer, no
model run. Echo with generation, and scoring with log-probs, are in control_plane/prompt_scoring.py."""
from __future__ import annotations

import time
import uuid


def echo_only(prompts: list[list[int]], tokenizer, model: str, return_ids: bool) -> dict:
    choices = []
    for i, ids in enumerate(prompts):
        choice = {"index": i, "text": tokenizer.decode(ids), "finish_reason": "length", "logprobs": None}
        if return_ids:
            choice["token_ids"] = []
        choices.append(choice)
    prompt = sum(len(ids) for ids in prompts)
    return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}}
