"""The raw bytes of one token, for the `bytes` of OpenAI's log-probs.

Decoding a lone token of a byte-level BPE vocabulary gives U+FFFD for a piece of a multi-byte
character, so the bytes come from the token's vocabulary string through GPT-2's byte-to-character
table; tokens outside that alphabet (special tokens, sentencepiece pieces) are their decoded text."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's table: printable bytes map to themselves, the others to code points from 256 up
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, token_id: int) -> list[int]:
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_decoder()
    if isinstance(piece, str) and piece and all(c in table for c in piece) \
            and token_id not in set(getattr(tokenizer, "all_special_ids", ())):
        return [table[c] for c in piece]
    return list(tokenizer.decode([token_id]).encode("utf-8"))
