"""Tool calling: the request's tools and tool_choice, the grammar that forces a call, and the parsing
of the generated text into OpenAI's `tool_calls`.

- auto: the model decides; calls are read back from `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (the Hermes form Qwen and SmolLM3 templates use, and the one chat.fold_tools teaches).
- required: the output is forced to one `{"name": ..., "arguments": {...}}` object, any listed tool.
- a named function: the output is forced to that function's arguments object.
- none: no call is parsed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from control_plane.sampling_params import ValidationError
from control_plane.structured import Constraint

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    tools: tuple            # the request's function definitions ({name, description, parameters})
    choice: str             # "auto" | "required" | "named"
    name: str | None = None # the forced function, for "named"


def check_tools(tools) -> list[dict]:
    """Each tool's name and parameters; raises ValidationError for a malformed list."""
    if not isinstance(tools, list):
        raise ValidationError("'tools' must be a list", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValidationError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools",
                                  "invalid_type")
        if not isinstance(fn.get("strict"), (bool, type(None))) or not isinstance(fn.get("description", ""), str):
            raise ValidationError(f"tools[{i}].function: 'strict' must be true or false and 'description' a string",
                                  "tools", "invalid_type")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ValidationError(f"tools[{i}].function.parameters must be a JSON schema object", "tools",
                                  "invalid_type")
        out.append({"name": fn["name"], "parameters": params})
    return out


def _functions(body: dict) -> list[dict]:
    tools = body.get("tools")
    return check_tools([] if tools is None else tools)


def parse_tool_choice(body: dict) -> ToolMode | None:
    functions = _functions(body)
    choice = body.get("tool_choice", "auto" if functions else "none")
    if choice == "none":
        return None
    if not functions:
        raise ValidationError("'tool_choice' needs 'tools'", "tool_choice")
    if choice in ("auto", "required"):
        return ToolMode(tuple(functions), choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValidationError("'tool_choice' must be 'auto', 'none', 'required' or {type: function, function: "
                              "{name}}", "tool_choice")
    if name not in {f["name"] for f in functions}:
        raise ValidationError(f"'tool_choice' names '{name}', which is not among the tools", "tool_choice")
    return ToolMode(tuple(functions), "named", name)


def forced_constraint(mode: ToolMode | None) -> Constraint | None:
    if mode is None or mode.choice == "auto":
        return None
    if mode.choice == "named":
        params = next(f["parameters"] for f in mode.tools if f["name"] == mode.name)
        return Constraint("json_schema", json.dumps(params))
    calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in mode.tools]
    return Constraint("json_schema", json.dumps({"anyOf": calls}))


def _call(name: str, arguments) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_output(mode: ToolMode, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished choice."""
    if mode.choice in ("named", "required"):
        try:
            value = json.loads(text)
        except ValueError:
            return text, []        # cut short (max_tokens): the text is returned as it is
        if mode.choice == "named":
            return None, [_call(mode.name, value)]
        return None, [_call(value["name"], value.get("arguments", {}))]
    calls, names = [], {f["name"] for f in mode.tools}
    for block in TOOL_CALL.findall(text):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("name") in names:
            calls.append(_call(value["name"], value.get("arguments", {})))
    if not calls:
        return text, []
    rest = TOOL_CALL.sub("", text).strip()
    return rest or None, calls
