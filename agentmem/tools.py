"""Tool calling on models whose chat template may or may not know about tools.

A template that takes ``tools`` (Qwen2.5, Qwen3, Llama 3.1 …) renders the tool list itself.
For one that does not (the embedded SmolLM2), the list is written into the system message in
the widely trained Hermes format. Either way the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Porto"}}
    </tool_call>

and :func:`parse_tool_calls` reads that back. Tool calls of earlier assistant turns are
written into the message text in the same format by :func:`format_tool_call`, so the rendered
history is the text the model produced.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentmem.errors import InvalidInput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions are listed "
    "in <tools></tools> tags:\n<tools>\n{specs}\n</tools>\n\nFor each function call, return a JSON "
    "object with the function name and arguments within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ParsedCalls:
    """A reply split into its text and its tool calls; unparsable calls are kept with the error."""

    text: str
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"}
    invalid: list[dict[str, Any]] = field(default_factory=list)  # {"raw", "error"}


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style function specs (``{"type": "function", "function": {"name": ...}}``), checked."""
    checked = []
    for i, spec in enumerate(tools):
        function = spec.get("function") if isinstance(spec, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidInput(f"tool {i} is not a function spec with a name: {spec!r}"[:300])
        checked.append({"type": "function", "function": dict(function)})
    return checked


def template_supports_tools(chat_template: Any) -> bool:
    return isinstance(chat_template, str) and "tools" in chat_template


def system_prompt_with_tools(system: str, tools: Sequence[Mapping[str, Any]]) -> str:
    """``system`` followed by the tool list and calling instructions (for templates without tools)."""
    specs = "\n".join(json.dumps(spec["function"], ensure_ascii=False) for spec in tools)
    instructions = _INSTRUCTIONS.format(specs=specs)
    return f"{system}\n\n{instructions}" if system else instructions


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' \
           f"{json.dumps(dict(arguments), ensure_ascii=False)}}}\n{CALL_CLOSE}"


def forced_call_prefix(name: str | None) -> str:
    """Reply text that commits the model to a call (of ``name`` when given)."""
    if name is None:
        return f'{CALL_OPEN}\n{{"name": "'
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def parse_tool_calls(text: str) -> ParsedCalls:
    """Split generated text into prose and ``<tool_call>`` blocks (a missing close tag at the end is tolerated)."""
    prose: list[str] = []
    parsed = ParsedCalls(text="")
    cursor = 0
    while (start := text.find(CALL_OPEN, cursor)) != -1:
        prose.append(text[cursor:start])
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN): end if end != -1 else len(text)]
        cursor = len(text) if end == -1 else end + len(CALL_CLOSE)
        try:
            call, _ = json.JSONDecoder().raw_decode(body.strip())
            arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
                raise ValueError("expected {\"name\": str, \"arguments\": object}")
            parsed.calls.append({"name": call["name"], "arguments": arguments})
        except ValueError as exc:
            parsed.invalid.append({"raw": body.strip(), "error": str(exc)})
    prose.append(text[cursor:])
    parsed.text = "".join(prose).strip()
    return parsed
