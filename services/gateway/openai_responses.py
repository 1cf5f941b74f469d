"""The OpenAI API's answers, pure: the gateway's chunks (`GenerateResponse`) in, a whole
completion or its server-sent events' JSON out, in the shapes of /v1/completions and
/v1/chat/completions (tool calls parsed out of the text, logprobs by token text, usage, and
the speculation statistics as the extension field `speculation`).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..v1 import common_pb2, generation_pb2
from .openai_api import CHAT, COMPLETIONS
from .tools import ToolCallStream, parse_tool_calls

FINISH = {  # the gateway's finish reason -> OpenAI's ("stop" for any other)
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_MAX_SEQ_LEN: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
}


@dataclass
class Completion:
    """One request's answer as it accumulates, and its OpenAI shapes (`kind` is COMPLETIONS or
    CHAT). The speculation statistics ride along as the extension field `speculation`."""

    kind: str
    model: str
    include_usage: bool = False
    token_text: Callable[[int], str] | None = None  # with logprobs: a token's own text
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    final: generation_pb2.FinalInfo | None = None
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # not yet sent
    offset: int = 0  # characters of the tokens sent before `logprobs` (completions' text_offset)
    tools: bool = False  # the model may call tools: its calls are parsed out of its text
    tool_stream: ToolCallStream = field(default_factory=ToolCallStream)
    calls: int = 0  # tool calls sent

    def _name(self, chunk: generation_pb2.GenerateResponse) -> None:
        if not self.id:
            self.id = ("cmpl-" if self.kind == COMPLETIONS else "chatcmpl-") + chunk.request_id

    def add(self, chunk: generation_pb2.GenerateResponse) -> None:
        self._name(chunk)
        self.text.append(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        if chunk.HasField("final"):
            self.final = chunk.final

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = self.kind + (".chunk" if chunk and self.kind == CHAT else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self, text: str, finish: str | None, delta: bool, calls: list[dict] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == COMPLETIONS:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text or (finish is None and not calls) else {}
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["message"] = {
                "role": "assistant",
                "content": text if text or not calls else None,
            }
            if calls:
                choice["message"]["tool_calls"] = [
                    {k: v for k, v in call.items() if k != "index"} for call in calls
                ]
        return choice | {"logprobs": self._logprobs(), "finish_reason": finish}

    def _tool_calls(self, calls: list[tuple[str, str]]) -> list[dict]:
        """Parsed calls in OpenAI's shape (`index` in a stream's deltas), numbered on."""
        out = []
        for name, arguments in calls:
            out.append(
                {
                    "index": self.calls,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
            self.calls += 1
        return out

    def _logprobs(self) -> dict[str, Any] | None:
        """OpenAI's `logprobs` of the tokens not yet sent (None unless the request asked)."""
        if self.token_text is None:
            return None
        entries, self.logprobs = self.logprobs, []
        text = self.token_text
        if self.kind == CHAT:
            return {
                "content": [
                    _chat_entry(text(e.token_id), e.logprob)
                    | {"top_logprobs": [_chat_entry(text(t.token_id), t.logprob) for t in e.top]}
                    for e in entries
                ],
                "refusal": None,
            }
        tokens = [text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [
                {text(t.token_id): _finite(t.logprob) for t in e.top} for e in entries
            ],
            "text_offset": offsets,
        }

    def response(self) -> dict[str, Any]:
        """The whole answer (stream: false)."""
        body = self._head(chunk=False)
        text, calls = "".join(self.text), []
        if self.tools:
            text, parsed = parse_tool_calls(text)
            text, calls = text.strip(), self._tool_calls(parsed)
        body["choices"] = [self._choice(text, self._finish(), delta=False, calls=calls)]
        return body | self._extensions(usage=True)

    def first_chunk(self, chunk: generation_pb2.GenerateResponse) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do (`chunk`, the stream's
        first, names the request; it goes out after this with `chunks`)."""
        self._name(chunk)
        if self.kind != CHAT:
            return None
        body = self._head(chunk=True)
        body["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
        body["choices"][0] |= {"logprobs": None, "finish_reason": None}
        return body | ({"usage": None} if self.include_usage else {})

    def chunks(self, chunk: generation_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """What one of the gateway's chunks becomes in an SSE stream."""
        self.add(chunk)
        text, calls = chunk.text, []
        if self.tools:  # (the call markup held back until a call is whole)
            text, parsed = self.tool_stream.push(text)
            if self.final is not None:
                text += self.tool_stream.flush()[0]
            calls = self._tool_calls(parsed)
            if self.calls and not text.strip():
                text = ""  # (the lines between calls)
        finish = self._finish() if self.final is not None else None
        if not text and not calls and finish is None:  # (its logprobs go with the next text)
            return []
        body = self._head(chunk=True)
        body["choices"] = [self._choice(text, finish, delta=True, calls=calls)]
        if finish is None:
            return [body | ({"usage": None} if self.include_usage else {})]
        out = [
            body | self._extensions(usage=False) | ({"usage": None} if self.include_usage else {})
        ]
        if self.include_usage:  # OpenAI's last chunk: usage, and no choices
            out.append(self._head(chunk=True) | {"choices": []} | self._extensions(usage=True))
        return out

    def _finish(self) -> str:
        reason = FINISH.get(self.final.finish_reason, "stop") if self.final else "stop"
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _extensions(self, usage: bool) -> dict[str, Any]:
        if self.final is None:
            return {}
        stats = self.final.speculation  # (as numbers: MessageToDict writes int64 as strings)
        out: dict[str, Any] = {
            "speculation": {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields},
            "system_fingerprint": self.final.model_version or None,
        }
        if usage:
            u = self.final.usage
            out["usage"] = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            }
        return out


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the model rules out (or one whose value is not known)
    gets -9999.0, as vLLM reports it."""
    return logprob if math.isfinite(logprob) else -9999.0
