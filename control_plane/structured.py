"""Structured output on xgrammar: the request's constraint, its compiled grammar, and one matcher
per constrained sequence, all in the control plane.

Each step the engine asks for the packed bitmask of every constrained sequence that samples; the plan
carries it (StepPlan.token_masks) and the data plane's sampler sets the other tokens to -inf. A
matcher advances only on a token that came back in a step result, so a failed step, a preemption
(swap or recompute: the tokens are kept) or a data-plane restart leaves it exactly in step with the
sequence's tokens; a forked parallel sample gets a matcher replayed over its own tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from control_plane.sampling_params import ValidationError


@dataclass(frozen=True)
class Constraint:
    kind: str      # "json_schema" | "json_object" | "regex" | "choice" | "grammar"
    value: str     # the schema as JSON text, the regex, the choices as JSON, the EBNF grammar


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ValidationError(f"'{param}' is not valid JSON", param, "invalid_json") from None
    if not isinstance(schema, (dict, bool)):
        raise ValidationError(f"'{param}' must be a JSON schema object", param, "invalid_type")
    return json.dumps(schema)


def parse_constraint(body: dict) -> Constraint | None:
    """OpenAI's response_format, vLLM's structured_outputs and the older guided_* fields."""
    found: list[Constraint] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(Constraint("json_object", ""))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValidationError("response_format json_schema needs {json_schema: {name, schema}}",
                                      "response_format", "invalid_type")
            found.append(Constraint("json_schema", _schema_text(spec["schema"], "response_format")))
        elif kind != "text":
            raise ValidationError("response_format.type must be 'text', 'json_object' or 'json_schema'",
                                  "response_format")
    so = body.get("structured_outputs") or {}
    if not isinstance(so, dict):
        raise ValidationError("'structured_outputs' must be an object", "structured_outputs", "invalid_type")
    fields = {"json": so.get("json", body.get("guided_json")), "regex": so.get("regex", body.get("guided_regex")),
              "choice": so.get("choice", body.get("guided_choice")),
              "grammar": so.get("grammar", body.get("guided_grammar"))}
    if fields["json"] is not None:
        found.append(Constraint("json_schema", _schema_text(fields["json"], "guided_json")))
    for kind in ("regex", "grammar"):
        if fields[kind] is not None:
            if not isinstance(fields[kind], str) or not fields[kind]:
                raise ValidationError(f"the {kind} must be a non-empty string", f"guided_{kind}", "invalid_type")
            found.append(Constraint(kind, fields[kind]))
    if fields["choice"] is not None:
        choices = fields["choice"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValidationError("the choice must be a list of non-empty strings", "guided_choice", "invalid_type")
        found.append(Constraint("choice", json.dumps(choices)))
    if len(found) > 1:
        raise ValidationError("give one structured-output constraint, not several", "response_format")
    return found[0] if found else None


class GrammarBackend:
    """xgrammar's compiler for one tokenizer; compiled grammars are cached by constraint."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        try:
            import xgrammar as xgr   # imported here: the control plane starts without it (and torch) until asked
        except ImportError:
            raise ValidationError("structured output needs the xgrammar package on the server: pip install "
                                  "'pagedserve[structured]'", "response_format", "unsupported") from None
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._cache: dict[Constraint, object] = {}

    def compile(self, c: Constraint):
        if c in self._cache:
            return self._cache[c]
        try:
            # JSON without free whitespace (", " and ": " only): a weak model otherwise can pad with
            # newlines until max_tokens and never close the object
            if c.kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif c.kind == "json_schema":
                compiled = self.compiler.compile_json_schema(c.value, strict_mode=True, any_whitespace=False)
            elif c.kind == "regex":
                compiled = self.compiler.compile_regex(c.value)
            elif c.kind == "choice":
                alts = " | ".join(json.dumps(s) for s in json.loads(c.value))
                compiled = self.compiler.compile_grammar(f"root ::= {alts}")
            else:
                compiled = self.compiler.compile_grammar(c.value)
        except Exception as exc:   # xgrammar raises RuntimeError/ValueError subclasses with the reason
            raise ValidationError(f"the {c.kind.replace('_', ' ')} constraint does not compile: {exc}",
                                  "response_format", "invalid_grammar") from None
        self._cache[c] = compiled
        return compiled

    def matcher(self, compiled, tokens: list[int] = ()):
        m = self.xgr.GrammarMatcher(compiled)
        for t in tokens:
            m.accept_token(t)
        return m


class Matchers:
    """The matcher of each constrained sequence, by seq id."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self.by_seq: dict[int, object] = {}
        self.compiled: dict[int, object] = {}
        self._bitmask = backend.xgr.allocate_token_bitmask(1, backend.vocab_size)

    def add(self, seq_id: int, compiled, output_ids: list[int] = ()) -> None:
        self.compiled[seq_id] = compiled
        self.by_seq[seq_id] = self.backend.matcher(compiled, output_ids)

    def fork(self, parent_id: int, child_id: int, child_output_ids: list[int]) -> None:
        if parent_id in self.compiled:
            self.add(child_id, self.compiled[parent_id], child_output_ids)

    def mask(self, seq_id: int) -> bytes:
        self.by_seq[seq_id].fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.numpy().tobytes()

    def accept(self, seq_id: int, token_id: int) -> bool:
        m = self.by_seq.get(seq_id)
        return True if m is None else bool(m.accept_token(token_id))

    def drop(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)
        self.compiled.pop(seq_id, None)

    def step_masks(self, seqs) -> list[tuple[int, bytes]]:
        """Masks of the constrained sequences among a planned step's `seqs` that sample in it: those whose
        every token the plan computes (the plan has already counted them as computed)."""
        return [(seq.seq_id, self.mask(seq.seq_id)) for seq in seqs
                if seq.seq_id in self.by_seq and seq.num_computed_tokens >= seq.num_tokens]
