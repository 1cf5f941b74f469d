"""The OpenAI API's shapes, pure: request bodies in, `GenerateRequest` out; chunks of the
gateway's stream in, OpenAI's responses out; the core's typed errors in, OpenAI's error JSON
and HTTP status out. `http_api` does the I/O.

Bodies are checked strictly (a string where a number belongs is a 400 naming the field);
fields this module does not know are ignored, as clients send fields at their defaults.
Fields it knows but cannot honour (n > 1, penalties, logit_bias...) are refused by name.
"""

from __future__ import annotations

import enum
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..common.logprob_format import MAX_TOP_LOGPROBS
from ..v1 import common_pb2, generation_pb2
from .errors import Code, GatewayError
from .tools import ToolCallStream, parse_tool_calls

COMPLETIONS, CHAT = "text_completion", "chat.completion"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples unless asked not to

# The core's error code -> (HTTP status, OpenAI error type, code), as the OpenAI API answers
# the same case.
HTTP_STATUS: dict[Code, tuple[int, str, str | None]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    Code.OUT_OF_RANGE: (400, "invalid_request_error", None),
    Code.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    Code.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    Code.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    Code.CANCELLED: (409, "cancelled", "request_cancelled"),
    Code.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    Code.INTERNAL: (500, "server_error", None),
    Code.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    Code.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}
# What a client must not send again as it is (the openai client retries 409 and 5xx unless told).
NOT_RETRIED = {Code.CANCELLED, Code.DEADLINE_EXCEEDED, Code.ALREADY_EXISTS}
INT32_MAX = 2**31 - 1
HTTP_NAMES = {"grammar": "response_format"}  # gRPC field -> the OpenAI request's
FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_MAX_SEQ_LEN: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def of(cls, error: GatewayError) -> ApiError:
        """The core's typed error as the OpenAI API's."""
        return cls.from_status(error.code, error.message, error.retry_after_ms)

    @classmethod
    def from_status(
        cls, code: Code | enum.Enum, details: str, retry_after_ms: int | None = None
    ) -> ApiError:
        """An error code (the core's, or a gRPC status of the same name) as the OpenAI API's
        error; a field the detail names ("max_tokens: ...") becomes `param`, and a retry hint
        becomes Retry-After."""
        code = Code.__members__.get(code.name)
        status, type_, openai_code = HTTP_STATUS.get(code, (500, "server_error", None))
        head, sep, rest = details.partition(": ")
        param = head if sep and status == 400 and " " not in head else None
        if param in HTTP_NAMES:  # (a gRPC field the HTTP request named otherwise)
            param = HTTP_NAMES[param]
            details = f"{param}: {rest}"
        headers = {}
        if retry_after_ms is not None:
            headers = {
                "Retry-After": str(max(1, -(-retry_after_ms // 1000))),  # whole seconds, up
                "retry-after-ms": str(retry_after_ms),  # (the openai client prefers this one)
            }
        if code in NOT_RETRIED:
            headers["x-should-retry"] = "false"
        return cls(status, details, type_, param, openai_code, headers)


INTERNAL = ApiError(500, "internal error", "server_error")  # (a bug's answer: no traceback)


# --- requests ----------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


PositiveInt = Annotated[int, Field(ge=1, le=INT32_MAX)]  # (the protos' fields are int32)
TokenList = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]


class _Body(_Strict):
    """What both endpoints take. `priority`, `session_id` and `speculation` are this
    service's own."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)  # (as vLLM takes it)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    service_tier: str | None = None
    priority: Literal["interactive", "batch"] | None = None
    session_id: str | None = None
    speculation: Literal["auto", "off"] | None = None
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | TokenList | list[str] | list[TokenList]
    max_tokens: PositiveInt | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # (as vLLM takes it on completions too)


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (a call of it is checked against its schema when forced)


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: dict[str, Any] | None = None


def parse(kind: str, raw: bytes) -> CompletionBody | ChatBody:
    """The body of a /v1/completions (`COMPLETIONS`) or /v1/chat/completions (`CHAT`) call;
    ApiError 400 naming the first field that is wrong."""
    model = CompletionBody if kind == COMPLETIONS else ChatBody
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {first['msg']}") from None
        if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
            raise ApiError(400, "the body must be a JSON object") from None
        param = ".".join(str(p) for p in first["loc"] if not _is_type_name(p))
        raise ApiError(400, f"{param}: {first['msg']}", param=param or None) from None
    _refuse_unsupported(body)
    return body


def _is_type_name(part: object) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[int]`): not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _refuse_unsupported(body: CompletionBody | ChatBody) -> None:
    def refuse(param: str, why: str) -> None:
        raise ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

    if body.n not in (None, 1):
        refuse("n", "only n = 1 is supported (send one request per completion)")
    if body.stream_options is not None and not body.stream:
        refuse("stream_options", "only allowed when stream is true")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            refuse(name, "penalties are not supported (only 0)")
    if body.logit_bias:
        refuse("logit_bias", "not supported")
    _grammar(body.response_format)  # (refused here if malformed)
    if isinstance(body, CompletionBody):
        if body.echo:
            refuse("echo", "not supported")
        if body.best_of not in (None, 1):
            refuse("best_of", "only best_of = 1 is supported")
        if body.suffix:
            refuse("suffix", "not supported")
        if isinstance(body.prompt, list) and not body.prompt:
            refuse("prompt", "must not be empty")
        if isinstance(body.prompt, list) and not isinstance(body.prompt[0], int):
            if len(body.prompt) != 1:
                refuse("prompt", "one prompt per request (a list of prompts is not supported)")
        return
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    for i, m in enumerate(body.messages):
        if m.role == "function":
            refuse(f"messages.{i}.role", "function messages are not supported (use tool)")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text" or part.text is None:
                refuse(f"messages.{i}.content.{j}", "only text content parts are supported")


def to_generate(body: CompletionBody | ChatBody) -> generation_pb2.GenerateRequest:
    """The gateway's request for an OpenAI body (which `parse` accepted)."""
    temperature = OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    sampling = common_pb2.SamplingParams(
        temperature=temperature, top_p=body.top_p or 0, top_k=body.top_k or 0
    )
    if body.seed is not None:
        sampling.seed = body.seed
    batch = body.priority == "batch" or body.service_tier == "flex"
    req = generation_pb2.GenerateRequest(
        sampling=sampling,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        priority=common_pb2.PRIORITY_CLASS_BATCH
        if batch
        else common_pb2.PRIORITY_CLASS_INTERACTIVE,
        session_id=body.session_id or "",
    )
    if body.speculation == "off":
        req.speculation.mode = common_pb2.SPECULATION_MODE_OFF
    if (grammar := _grammar(body.response_format)) is not None:
        req.grammar.CopyFrom(grammar)
    if isinstance(body, CompletionBody):
        req.max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        if body.logprobs is not None:  # (the count of top tokens: 0 is the chosen one alone)
            req.logprobs, req.top_logprobs = True, body.logprobs
        prompt = body.prompt
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a list of one prompt
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_ids.ids.extend(prompt)
        return req
    req.max_tokens = body.max_completion_tokens or body.max_tokens or 0  # 0: the gateway's
    req.logprobs, req.top_logprobs = bool(body.logprobs), body.top_logprobs or 0
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role  # (developer is OpenAI's new system)
        parts = m.content if isinstance(m.content, list) else [m.content or ""]
        text = "\n".join(p if isinstance(p, str) else p.text or "" for p in parts)
        message = req.messages.messages.add(
            role=role, content=text, tool_call_id=m.tool_call_id or ""
        )
        for call in m.tool_calls or []:
            message.tool_calls.add(
                id=call.id, name=call.function.name, arguments=call.function.arguments
            )
    for tool in body.tools or []:
        f = tool.function
        parameters = "" if f.parameters is None else json.dumps(f.parameters)
        req.tools.add(name=f.name, description=f.description or "", parameters=parameters)
    if isinstance(body.tool_choice, str):
        req.tool_choice.mode = body.tool_choice
    elif body.tool_choice is not None:
        req.tool_choice.function = body.tool_choice.function.name
    return req


def calls_tools(req: generation_pb2.GenerateRequest) -> bool:
    """Whether the model may answer a request with tool calls (parsed out of its text)."""
    return bool(req.tools) and req.tool_choice.mode != "none"


def _grammar(response_format: dict[str, Any] | None) -> common_pb2.Grammar | None:
    """The grammar a `response_format` asks for: none for text, any JSON object for
    `json_object`, the schema of `json_schema` ({"name", "schema", "strict"}); a 400 naming
    response_format for anything else. (Whether the schema compiles, the gateway says.)"""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.Grammar(json_schema='{"type": "object"}')
    if kind != "json_schema":
        raise ApiError(
            400,
            f"response_format: type must be text, json_object or json_schema, got {kind!r}"[:200],
            param="response_format",
        )
    spec = response_format.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict | bool):
        raise ApiError(
            400,
            'response_format: json_schema must be {"name": ..., "schema": {...}}',
            param="response_format",
        )
    return common_pb2.Grammar(json_schema=json.dumps(schema))


# --- responses ---------------------------------------------------------------------------------
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
