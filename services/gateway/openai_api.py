"""The OpenAI API's requests and errors, pure: request bodies in, `GenerateRequest` out; the
core's typed errors in, OpenAI's error JSON and HTTP status out. (openai_responses.py makes
the answers; http_api.py does the I/O.)

Bodies are checked strictly (a string where a number belongs is a 400 naming the field);
fields this module does not know are ignored, as clients send fields at their defaults.
Fields it knows but cannot honour (n > 1, penalties, logit_bias...) are refused by name.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..common.logprob_format import MAX_TOP_LOGPROBS
from ..v1 import common_pb2, generation_pb2
from .errors import Code, GatewayError

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
        api = cls.from_status(error.code, error.message, error.retry_after_ms)
        if not error.retryable:
            api.headers["x-should-retry"] = "false"
        return api

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
