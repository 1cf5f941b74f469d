"""Tool calls in the Hermes convention that Qwen2.5's chat template (the default target's)
renders and its models are trained on: a call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for several
calls. Pure: a request's messages and tools as chat templates take them (the gateway renders
them with the model's own template), a `tool_choice` as a grammar, and the model's output back
as calls.

- `tool_grammar`: what `required` (one call or more, of any tool) or a named function (one
  call of it) allows: a Lark grammar around the calls' JSON schemas, for llguidance.
- `parse_tool_calls`, `ToolCallStream`: an output split into text and calls, whole or as it
  streams (the markup held back until a call is complete, so none of it reaches the text).
  A block that is not a well-formed call stays text.
"""

from __future__ import annotations

import json

from ..speculation.grammar import JSON_DEFAULTS
from .validation import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def supported(chat_template: str | None) -> bool:
    """Whether a model's chat template renders tools and Hermes-style calls."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


def tool_grammar(tools: dict[str, dict], only: str | None, special_markup: bool) -> str:
    """The Lark grammar of one call of `only`, or one call or more of any of `tools` (name ->
    parameters schema). `special_markup`: the tokenizer has <tool_call> and </tool_call> as
    special tokens (Qwen2.5's), which the grammar then names as tokens, else as text."""
    names = [only] if only is not None else list(tools)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": tools[name] or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_DEFAULTS
    open_, close = (OPEN, CLOSE) if special_markup else (json.dumps(OPEN), json.dumps(CLOSE))
    start = "call" if only is not None else 'call ("\\n" call)*'
    return f'start: {start}\ncall: {open_} "\\n" %json {json.dumps(schema)} "\\n" {close}\n'


def _call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's inside, or None if it is not one."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # (some models write the arguments as a JSON string)
        return call["name"], arguments
    return call["name"], json.dumps(arguments)


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text outside the calls, and each call's (name, arguments) in order."""
    stream = ToolCallStream()
    content, calls = stream.push(text)
    rest, _ = stream.flush()
    return content + rest, calls


class ToolCallStream:
    """An output's text as it streams: `push` returns the text that is surely not part of a
    call (a possible start of the markup at the end is held back) and the calls completed."""

    def __init__(self):
        self.buffer = ""
        self.inside = False  # after an OPEN, before its CLOSE

    def push(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        self.buffer += text
        out, calls = [], []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                block, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE) :]
                self.inside = False
                call = _call(block.strip())
                if call is None:
                    out.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                out.append(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(OPEN) :], True
                continue
            held = _partial(self.buffer, OPEN)
            out.append(self.buffer[: len(self.buffer) - held])
            self.buffer = self.buffer[len(self.buffer) - held :]
            break
        return "".join(out), calls

    def flush(self) -> tuple[str, list[tuple[str, str]]]:
        """What is left at the end: an unfinished call is text."""
        text = (OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return text, []


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def chat_messages(messages) -> list[dict]:
    """A request's ChatMessages as its chat template takes them (a call's arguments as an
    object: templates write them out themselves)."""
    out = []
    for i, m in enumerate(messages):
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": _json(call.arguments, f"messages[{i}].tool_calls[{j}]"),
                    },
                }
                for j, call in enumerate(m.tool_calls)
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def tool_parameters(tools) -> dict[str, dict]:
    """Each tool's parameters schema by its name (an empty one: any object)."""
    return {
        t.name: _json(t.parameters, f"tools[{i}].parameters") if t.parameters else {}
        for i, t in enumerate(tools)
    }


def template_tools(tools, parameters: dict[str, dict]) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": parameters[t.name] or {"type": "object"},
            },
        }
        for t in tools
    ] or None


def _json(text: str, field: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequest(field, f"not valid JSON ({e})") from None
