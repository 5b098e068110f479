"""A schemathesis check loaded by tests/e2e/test_openapi_schemathesis.py (SCHEMATHESIS_HOOKS): where
schemathesis.toml lets a schema-valid body get a 400 (rules JSON Schema cannot state), the 400 must
name one of those rules, by its (param, code), and nothing else."""
import json

import schemathesis

# (param, code) of each rule a schema-valid body can break, and why the schema cannot say it
CROSS_FIELD = {
    # continuing the last message needs that message to be the assistant's (JSON Schema has no "last item")
    ("continue_final_message", "invalid_value"),
    # response_format, structured_outputs and the guided_* fields: at most one of them
    ("response_format", "invalid_value"),
    # a grammar, regex or JSON schema that xgrammar cannot compile
    ("response_format", "invalid_grammar"),
    # guided_json given as text: the string must hold JSON, and that JSON a schema (an object or a boolean)
    ("guided_json", "invalid_json"), ("guided_json", "invalid_type"),
    # likewise a tool call's arguments given as text must hold JSON
    ("messages", "invalid_json"),
    # tool_choice needs tools, and a named one must be among them
    ("tool_choice", "invalid_value"),
    # the prompt (as the chat template renders it) plus max_tokens must fit the context and the KV pool
    ("messages", "context_length_exceeded"), ("max_tokens", "context_length_exceeded"),
    # logit_bias keys are token ids as strings: a pattern cannot bound them by the vocabulary size
    ("logit_bias", "invalid_token_id"),
    # best_of >= n, and a beam width of at least 2; min_tokens <= max_tokens; max_tokens 0 only to score a
    # prompt (with echo or prompt_logprobs)
    ("best_of", "invalid_value"), ("min_tokens", "invalid_value"), ("max_tokens", "invalid_value"),
    # what does not combine: streaming with beam search or best_of > n, beam search with structured
    # output or prompt log-probs, prompt_logprobs on a streamed chat
    ("stream", "unsupported"), ("use_beam_search", "unsupported"), ("prompt_logprobs", "unsupported"),
}


@schemathesis.check
def schema_valid_refused_only_by_cross_field_rules(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"a 400 without an OpenAI error body: {response.content[:200]!r}") from None
    if (error["param"], error["code"]) not in CROSS_FIELD:
        raise AssertionError(f"schema-valid body refused with param={error['param']!r} code={error['code']!r}: "
                             f"{error['message']}")
    return None
