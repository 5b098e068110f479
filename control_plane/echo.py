"""Completions' `echo`: the prompt's text before the generated text, and `max_tokens: 0`, which
generates nothing and answers with the prompt alone (a scoring request)."""
from __future__ import annotations

import time
import uuid


def prompt_text(request, tokenizer) -> str:
    return tokenizer.decode(request.prompt_ids if hasattr(request, "prompt_ids") else request)


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
