"""Chat messages in OpenAI's shapes, normalized and rendered to token ids by the model's chat template.

What clients send and the template expects differ in a few ways, all settled here:
  - content may be a string, null (an assistant turn that only calls tools), or a list of parts;
    text parts are joined with newlines (as vLLM does), any other part type is refused by name,
  - `developer` is OpenAI's newer name for `system`,
  - assistant `tool_calls` carry `arguments` as a JSON string; Hugging Face templates expect a dict,
  - `tool` messages answer a call by `tool_call_id`, which templates may print.
"""
from __future__ import annotations

import json

from control_plane.sampling_params import ValidationError

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                            "function_call", "reasoning_content"})
# apply_chat_template arguments a client's chat_template_kwargs must not replace
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                                      "return_dict", "return_tensors", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tokenizer_kwargs"})


def _text_of(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"{where}.content must be a string, null or a list of content parts",
                              "messages", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):     # a bare string part: some clients send these
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) else "without a 'type'"
            raise ValidationError(f"{where}.content[{j}] is a part of type {shown}; this server takes only "
                                  "'text' parts (it serves a text-only model)", "messages",
                                  "unsupported_content_part")
        if not isinstance(part.get("text"), str):
            raise ValidationError(f"{where}.content[{j}] of type 'text' needs a string 'text'", "messages",
                                  "invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ValidationError(f"{where}.tool_calls must be a list", "messages", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValidationError(f"{where}.tool_calls[{j}] needs a 'function' with a string 'name'",
                                  "messages", "invalid_type")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise ValidationError(f"{where}.tool_calls[{j}].function.arguments must be a JSON string or an object",
                                  "messages", "invalid_type")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValidationError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                                      "messages", "invalid_json") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(messages) -> list[dict]:
    """The messages as a Hugging Face chat template takes them; raises ValidationError naming the fault."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValidationError(f"{where} must be an object", "messages", "invalid_type")
        extra = sorted(k for k in m if k not in MESSAGE_FIELDS)
        if extra:
            raise ValidationError(f"{where} has unknown field(s) {', '.join(map(repr, extra))}", "messages",
                                  "unknown_field")
        for key, kind in (("refusal", str), ("reasoning_content", str), ("function_call", dict)):
            if not isinstance(m.get(key), (kind, type(None))):   # ignored, but of the type OpenAI gives them
                raise ValidationError(f"{where}.{key} must be {'a string' if kind is str else 'an object'} or null",
                                      "messages", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ValidationError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages",
                                  "invalid_type")
        content = _text_of(m.get("content"), where)
        msg: dict = {"role": "system" if role == "developer" else role}
        calls = _tool_calls(m["tool_calls"], where) if m.get("tool_calls") is not None else []
        if role == "assistant" and calls:
            msg["tool_calls"] = calls
        elif content is None:
            raise ValidationError(f"{where} needs a 'content' (only an assistant message with tool_calls may "
                                  "leave it out)", "messages", "invalid_type")
        msg["content"] = content if content is not None else ""
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise ValidationError(f"{where}.{key} must be a string", "messages", "invalid_type")
                msg[key] = m[key]
        if role == "tool" and "tool_call_id" not in msg:
            raise ValidationError(f"{where} has role 'tool' and needs the 'tool_call_id' it answers",
                                  "messages", "invalid_value")
        out.append(msg)
    return out


def template_options(body: dict) -> dict:
    """add_generation_prompt, continue_final_message and chat_template_kwargs, checked."""
    gen = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    for name, value in (("add_generation_prompt", gen), ("continue_final_message", cont)):
        if not isinstance(value, bool):
            raise ValidationError(f"'{name}' must be true or false", name, "invalid_type")
    if gen and cont:
        raise ValidationError("'continue_final_message' continues the last message, so it cannot be used with "
                              "'add_generation_prompt' (set that to false)", "continue_final_message")
    extra = body.get("chat_template_kwargs")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValidationError("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValidationError(f"'chat_template_kwargs' may not set {', '.join(map(repr, reserved))}; use the "
                              "request's own fields", "chat_template_kwargs")
    return {"add_generation_prompt": gen, "continue_final_message": cont, **extra}


def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tool" in template


def fold_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that prints neither tools nor tool calls (SmolLM2's prints only role and
    content): the tools go into the system message and each call into its assistant message's text,
    in the Hermes form `<tool_call>{json}</tool_call>` that `tools.parse_tool_calls` reads back, so
    neither is dropped silently."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]})
                             + "\n</tool_call>" for c in calls)
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        text = ("You may call one or more functions. Their signatures are listed in <tools></tools>:\n"
                f"<tools>\n{listing}\n</tools>\nTo call one, answer with a JSON object holding its name and "
                'arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
                '"arguments": <args-json-object>}\n</tool_call>')
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render(tokenizer, messages: list[dict], tools: list[dict] | None, options: dict) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template."""
    if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
        raise ValidationError("'continue_final_message' needs the last message to be the assistant's",
                              "continue_final_message")
    if tools is not None:
        from control_plane.tools import check_tools
        check_tools(tools)   # before the template sees them
    if not template_knows_tools(tokenizer):
        messages, tools = fold_tools(messages, tools), None
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, **options)
    except ValidationError:
        raise
    except Exception as exc:   # jinja2 errors (raise_exception in a template), bad kwargs, ...
        raise ValidationError(f"the model's chat template refused the conversation: {exc}", "messages",
                              "chat_template_error") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
