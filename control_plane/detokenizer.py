"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and
for tokenizers that join words with spaces, so each step decodes a short window of tokens
twice: up to the last emitted token (prefix) and up to the newest one; the difference is
the new text, held back while it ends in an incomplete character ("\\ufffd").
"""
from __future__ import annotations

INITIAL_WINDOW = 5  # tokens of context before the first new token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-INITIAL_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""            # all output text so far (before stop-string truncation)
        self.stop = stop
        self.emitted = 0          # characters of self.text already handed to the client
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.include_stop = include_stop            # vLLM's include_stop_str_in_output
        self.skip_special = skip_special_tokens

    def add(self, token_id: int, skip: bool = False) -> None:
        """Appends one generated token; `skip` for tokens that produce no text (stop tokens)."""
        if skip:
            return
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def find_stop(self) -> bool:
        """True when a stop string appeared; the text is cut before it."""
        if not self.stop:
            return False
        # only the tail can hold a stop string that was not there before
        start = max(0, self.emitted - self.holdback)
        found = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not found:
            return False
        cut, length = min(found)
        self.text = self.text[:cut + (length if self.include_stop else 0)]
        return True

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what might begin a stop string."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        new = self.text[self.emitted:end]
        self.emitted = end
        return new
