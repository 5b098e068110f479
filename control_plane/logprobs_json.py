"""Log-probs in the shapes the API returns: chat's `content` list, the completions endpoint's legacy
lists (tokens, token_logprobs, top_logprobs, text_offset), and vLLM's `prompt_logprobs`.

A prompt token's entry comes from Request.prompt_logprobs: (logprob, rank, top alternatives), None at
position 0, which has no token before it."""
from __future__ import annotations

from control_plane.token_bytes import token_bytes


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def legacy(items, tokenizer, start_offset: int = 0) -> dict:
    """items: (token id, its logprob or None, its alternatives as (id, logprob) pairs or None).
    text_offset: where each token's text starts in the choice's text (the lengths of the tokens' own
    texts added up, as OpenAI and vLLM count them)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start_offset
    for token_id, logprob, top in items:
        text = _text(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else {_text(tokenizer, i): lp for i, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def generated(outputs, tokenizer, chat: bool, start_offset: int = 0) -> dict | None:
    """The sampled tokens' log-probs of a choice's outputs (RequestOutput), or None when none were asked."""
    tokens = [t for o in outputs for t in o.logprobs]
    if not tokens:
        return None
    if chat:
        def entry(tid, lp):
            return {"token": _text(tokenizer, tid), "logprob": lp, "bytes": token_bytes(tokenizer, tid)}
        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs]}
                            for t in tokens]}
    return legacy([(t.token_id, t.logprob, t.top_logprobs) for t in tokens], tokenizer, start_offset)


def prompt_legacy(prompt_ids: list[int], scores: list, k: int, tokenizer) -> dict:
    """echo with logprobs: the prompt's tokens in the legacy lists. Each token's top_logprobs holds the
    k most likely tokens and the prompt token itself (as OpenAI's and vLLM's echo do); the first is null."""
    items = [(prompt_ids[0], None, None)]
    for token_id, score in zip(prompt_ids[1:], scores[1:]):
        logprob, _, top = score
        items.append((token_id, logprob, list(top[:k]) + [(token_id, logprob)]))
    return legacy(items, tokenizer)


def merge(prompt_part: dict, generated_part: dict | None) -> dict:
    if generated_part is None:
        return prompt_part
    return {key: prompt_part[key] + generated_part[key] for key in prompt_part}


def vllm_prompt(prompt_ids: list[int], scores: list, k: int, tokenizer) -> list:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the k most likely tokens (rank 1 is the most likely)."""
    out: list = [None]
    for token_id, score in zip(prompt_ids[1:], scores[1:]):
        logprob, rank, top = score
        entry = {token_id: {"logprob": logprob, "rank": rank, "decoded_token": _text(tokenizer, token_id)}}
        for j, (alt, alt_logprob) in enumerate(top[:k]):
            entry.setdefault(alt, {"logprob": alt_logprob, "rank": j + 1, "decoded_token": _text(tokenizer, alt)})
        out.append(entry)
    return out
