"""JSON Schema of the request fields added for client compatibility (issue 12): chat messages in all
of OpenAI's shapes, tools, response formats, echo and scoring, and the vLLM extensions users send.

`api_schema` merges these tables into the published request schemas, so `check_fields` accepts
exactly what is listed here; the values are validated where they are used.
"""
from __future__ import annotations

from control_plane.sampling_params import MAX_LOGPROBS


def _t(types, desc: str, **extra) -> dict:
    return {"type": types, "description": desc, **extra}


TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGE_PROPERTIES = {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"],
             "description": "'developer' is taken as 'system'"},
    "content": {"description": "a string, a list of text parts (joined with newlines), or null for an "
                               "assistant message with tool_calls",
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [{"type": "string"}, TEXT_PART]}},
                          {"type": "null"}]},
    "name": {"type": ["string", "null"], "description": "passed to the chat template"},
    "tool_calls": {"type": ["array", "null"], "description": "an assistant's earlier calls, for the template",
                   "items": {"type": "object", "required": ["function"], "properties": {"function": {
                       "type": "object", "required": ["name"], "properties": {
                           "name": {"type": "string"},
                           "arguments": {"description": "the arguments as JSON text, or an object",
                                         "type": ["string", "object"]}}}}}},
    "tool_call_id": {"type": ["string", "null"], "description": "the call a 'tool' message answers"},
    "refusal": {"type": ["string", "null"], "description": "accepted and ignored"},
    "function_call": {"type": ["object", "null"], "description": "accepted and ignored (deprecated)"},
    "reasoning_content": {"type": ["string", "null"], "description": "accepted and ignored"},
}

STREAM_OPTIONS = _t(["object", "null"], "include_usage: a last chunk with the usage; continuous_usage_stats: "
                    "usage on every chunk", properties={"include_usage": {"type": ["boolean", "null"]},
                                                        "continuous_usage_stats": {"type": ["boolean", "null"]}})

LOGIT_BIAS = _t(["object", "null"], "token id (as a string) -> bias in [-100, 100] added to its logit",
                additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
                propertyNames={"pattern": "^[0-9]+$"}, maxProperties=300)

# vLLM's sampling extensions, on both endpoints
VLLM_SAMPLING = {
    "include_stop_str_in_output": _t(["boolean", "null"], "keep the matched stop string in the text"),
    "skip_special_tokens": _t(["boolean", "null"], "drop special tokens from the text (default true)"),
    "spaces_between_special_tokens": _t(["boolean", "null"], "accepted; the tokenizer's decoding decides"),
    "allowed_token_ids": _t(["array", "null"], "sample only among these token ids (at least one)",
                            items={"type": "integer", "minimum": 0}, minItems=1, maxItems=65536),
    "bad_words": _t(["array", "null"], "words (strings) never generated", items={"type": "string", "minLength": 1},
                    maxItems=100),
    "truncate_prompt_tokens": _t(["integer", "null"], "keep only the prompt's last k tokens", minimum=1),
    "logit_bias": LOGIT_BIAS,
    "prompt_logprobs": _t(["integer", "null"], "each prompt token's log-prob (null for the first), rank and this "
                          "many alternatives, in vLLM's shape (the raw model distribution)", minimum=0, maximum=MAX_LOGPROBS),
}

COMPLETION_EXTENSIONS = {
    **VLLM_SAMPLING,
    "echo": _t(["boolean", "null"], "the prompt is returned before the completion (with its log-probs when "
                                    "logprobs is set: the first is null; with max_tokens 0 this scores the prompt)"),
}

TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}

CHAT_EXTENSIONS = {
    **VLLM_SAMPLING,
    "tools": _t(["array", "null"], "functions the model may call; given to the chat template", items=TOOL),
    "tool_choice": {"description": "'auto', 'none', 'required', or {type: function, function: {name}}",
                    "anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}, {"type": "null"}]},
    "response_format": {"description": "{type: text}, {type: json_object}, or {type: json_schema, json_schema: "
                                       "{name, schema, strict}}", "anyOf": [
                            {"type": "object", "required": ["type"],
                             "properties": {"type": {"enum": ["text", "json_object"]}}},
                            {"type": "object", "required": ["type", "json_schema"], "properties": {
                                "type": {"const": "json_schema"},
                                "json_schema": {"type": "object", "required": ["schema"],
                                                "properties": {"schema": {"type": ["object", "boolean"]}}}}},
                            {"type": "null"}]},
    "structured_outputs": _t(["object", "null"], "vLLM: one of {json, regex, choice, grammar}", properties={
        "json": {"type": ["object", "boolean", "string", "null"]},
        "regex": {"type": ["string", "null"], "minLength": 1}, "grammar": {"type": ["string", "null"], "minLength": 1},
        "choice": {"type": ["array", "null"], "items": {"type": "string", "minLength": 1}, "minItems": 1}}),
    "guided_json": _t(["object", "boolean", "string", "null"], "vLLM (older): a JSON schema the output follows, "
                      "or its JSON text"),
    "guided_regex": _t(["string", "null"], "vLLM (older): a regex the output matches", minLength=1),
    "guided_choice": _t(["array", "null"], "vLLM (older): the output is one of these strings",
                        items={"type": "string", "minLength": 1}, minItems=1),
    "guided_grammar": _t(["string", "null"], "vLLM (older): an EBNF grammar (xgrammar's dialect)", minLength=1),
    "chat_template_kwargs": _t(["object", "null"], "extra variables for the chat template"),
    "add_generation_prompt": _t(["boolean", "null"], "end the prompt with the assistant's header (default true)"),
    "continue_final_message": _t(["boolean", "null"], "continue the last (assistant) message instead of "
                                                      "starting a new one"),
}

# the vLLM constraint fields are on the completions endpoint too
COMPLETION_EXTENSIONS.update({k: CHAT_EXTENSIONS[k] for k in ("structured_outputs", "guided_json", "guided_regex",
                                                              "guided_choice", "guided_grammar")})
