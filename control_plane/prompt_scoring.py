"""Scoring a prompt: completions' `echo` (with `logprobs`, the prompt's tokens and log-probs come before
the generated ones), `max_tokens: 0` (nothing generated is returned) and vLLM's `prompt_logprobs`.

How the numbers are made: SamplingParams.prompt_logprobs = k asks the data plane for each prompt token's
log-prob, rank and k alternatives (data_plane/prompt_logprobs.py: the raw model distribution, before
temperature, penalties and logit_bias). A sequence that asks gets no prefix-cache hit, so every prompt
position is computed. The step results carry them; `record` keeps one value per position on the Request,
and the Request's first output comes only after its prompt is whole, so they are complete by then.

`max_tokens: 0` with log-probs runs the prompt and samples one token, which is dropped (as vLLM does);
without log-probs (echo alone) nothing runs at all (control_plane/echo.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from control_plane import logprobs_json
from control_plane.sampling_params import MAX_LOGPROBS, SamplingParams, ValidationError, flag


def _prompt_logprobs_field(body: dict) -> int | None:
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError("'prompt_logprobs' must be an integer", "prompt_logprobs", "invalid_type")
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValidationError(f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {value}", "prompt_logprobs")
    return value


@dataclass
class Scoring:
    """What one HTTP request asked of its prompt, and the state of its stream."""
    tokenizer: object
    echo: bool = False              # completions: the prompt's text comes first
    score_only: bool = False        # max_tokens 0: the prompt alone, nothing generated
    echo_k: int | None = None       # echo with logprobs: the prompt joins the legacy lists, k alternatives
    vllm_k: int | None = None       # prompt_logprobs: vLLM's per-token dicts, k alternatives
    logprobs: bool = False          # the generated tokens' log-probs were asked
    stream: bool = False
    offsets: dict[int, int] = field(default_factory=dict)   # stream: characters of each choice sent so far

    @property
    def needs_scores(self) -> bool:
        return self.echo_k is not None or self.vllm_k is not None

    @property
    def text_only(self) -> bool:
        """max_tokens 0 with echo and no log-probs: answered from the tokenizer, no model run (streamed, it
        takes the engine's path, for its server-sent events)."""
        return self.score_only and not self.needs_scores and not self.stream

    # --- the whole answer ---------------------------------------------------------------------
    def _prompt_fields(self, req) -> dict:
        fields: dict = {}
        text = req.tokenizer.decode(req.prompt_ids) if self.echo else ""
        fields["text"] = text
        if self.echo_k is not None:
            fields["logprobs"] = logprobs_json.prompt_legacy(req.prompt_ids, req.prompt_logprobs, self.echo_k,
                                                            self.tokenizer)
        if self.vllm_k is not None:
            fields["prompt_logprobs"] = self.vllm_prompt(req)
        return fields

    def vllm_prompt(self, req) -> list:
        return logprobs_json.vllm_prompt(req.prompt_ids, req.prompt_logprobs, self.vllm_k, self.tokenizer)

    def fill_choice(self, choice: dict, req, outputs, text: str) -> None:
        """A completions choice of a whole (non-streamed) answer: text, logprobs, prompt_logprobs."""
        head = self._prompt_fields(req)
        prompt_text = head["text"]
        if self.score_only:
            outputs, text = [], ""
            choice["finish_reason"] = "length"
            if "token_ids" in choice:
                choice["token_ids"] = []
        gen = logprobs_json.generated(outputs, self.tokenizer, False, len(prompt_text))
        if "logprobs" in head:
            gen = logprobs_json.merge(head["logprobs"], gen)
        elif self.score_only and self.logprobs:
            gen = logprobs_json.legacy([], self.tokenizer)   # asked, and nothing was generated: empty lists
        choice["text"] = prompt_text + text
        choice["logprobs"] = gen
        if "prompt_logprobs" in head:
            choice["prompt_logprobs"] = head["prompt_logprobs"]

    # --- streaming ------------------------------------------------------------------------------
    def opening(self, index: int, req) -> dict | None:
        """Echo's prompt chunk, sent before anything is generated, when it needs no log-probs (those
        exist only once the prompt is computed: then `stream_choices` sends it with the first output)."""
        if not self.echo or self.needs_scores:
            return None
        text = req.tokenizer.decode(req.prompt_ids)
        self.offsets[index] = len(text)
        return {"index": index, "text": text, "finish_reason": None, "logprobs": None}

    def stream_choices(self, index: int, req, out, choice: dict) -> list[dict]:
        """The chunks' choices for one output of a choice: the prompt's chunk first if it is due, then
        `choice` (the output's, built by the API) with its text, log-probs and offsets set."""
        chunks = []
        if index not in self.offsets:
            head = {"index": index, "finish_reason": None, "logprobs": None, **self._prompt_fields(req)}
            self.offsets[index] = len(head["text"])
            if self.echo or self.vllm_k is not None:
                chunks.append(head)
        if self.score_only:
            choice.update(text="", logprobs=None, finish_reason="length")
            if "token_ids" in choice:
                choice["token_ids"] = []
        else:
            choice["text"] = out.text
            choice["logprobs"] = logprobs_json.generated([out], self.tokenizer, False, self.offsets[index])
            self.offsets[index] += len(out.text)
        chunks.append(choice)
        return chunks


def parse(body: dict, params: SamplingParams, chat: bool, score_only: bool, stream: bool, tokenizer) -> Scoring:
    """Checks echo, prompt_logprobs and max_tokens 0 together; sets params.prompt_logprobs."""
    echo = not chat and flag(body, "echo")
    vllm_k = _prompt_logprobs_field(body)
    scoring = Scoring(tokenizer, echo, score_only, params.logprobs if echo else None, vllm_k,
                      params.logprobs is not None, stream=stream)
    if score_only and not (echo or vllm_k is not None):
        raise ValidationError("'max_tokens' 0 generates nothing: it is for scoring a prompt, with 'echo' or "
                              "'prompt_logprobs'; ask for at least 1 token otherwise", "max_tokens")
    if scoring.needs_scores:
        if params.use_beam_search:
            raise ValidationError("prompt log-probs (echo with logprobs, prompt_logprobs) are not available with "
                                  "beam search", "use_beam_search", "unsupported")
        if chat and stream and vllm_k is not None:
            raise ValidationError("'prompt_logprobs' is not available on a streamed chat completion; send "
                                  "stream: false", "prompt_logprobs", "unsupported")
        params.prompt_logprobs = max(k for k in (scoring.echo_k, vllm_k) if k is not None)
    return scoring


def record(owners: dict, entries) -> None:
    """Keeps each computed prompt position's (logprob, rank, alternatives) on its request; a position
    computed again (a recompute after preemption or a data-plane restart) is overwritten with its equal."""
    for entry in entries:
        req = owners.get(entry.seq_id)
        if req is None or req.prompt_logprobs is None:
            continue   # ended while the step ran
        store = req.prompt_logprobs
        for i, (logprob, rank) in enumerate(zip(entry.logprobs, entry.ranks)):
            position = entry.first_position + i
            if position < len(store):
                store[position] = (logprob, rank, entry.top[i] if entry.top else [])
