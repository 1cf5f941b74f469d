"""The gateway's typed errors on both wires: every `Code` is the gRPC status of its name (with
its retry hint as a trailer, through a real in-process gRPC server) and the HTTP status, error
JSON and retry headers the OpenAI API answers the same case with, as the official openai client
reads them (its own status-to-exception and retry decisions)."""

from __future__ import annotations

import asyncio

import grpc
import httpx2
import openai
import pytest

from specserve.gateway.errors import Code, GatewayError
from specserve.gateway.grpc_api import _abort
from specserve.gateway.openai_api import HTTP_STATUS, NOT_RETRIED, ApiError

# What the OpenAI API answers each case with, as its client tells them apart: (HTTP status,
# the exception the openai client raises, whether it sends the request again by itself).
OPENAI = {
    Code.INVALID_ARGUMENT: (400, openai.BadRequestError, False),
    Code.OUT_OF_RANGE: (400, openai.BadRequestError, False),
    Code.UNAUTHENTICATED: (401, openai.AuthenticationError, False),
    Code.PERMISSION_DENIED: (403, openai.PermissionDeniedError, False),
    Code.NOT_FOUND: (404, openai.NotFoundError, False),
    Code.CANCELLED: (409, openai.ConflictError, False),  # (ended: sending it again won't help)
    Code.ALREADY_EXISTS: (409, openai.ConflictError, False),  # (the id is another request's)
    Code.RESOURCE_EXHAUSTED: (429, openai.RateLimitError, True),
    Code.INTERNAL: (500, openai.InternalServerError, True),
    Code.UNAVAILABLE: (503, openai.InternalServerError, True),
    Code.DEADLINE_EXCEEDED: (504, openai.InternalServerError, False),
}
URL = "http://127.0.0.1:9/v1/completions"


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    """The official client (never connected: only its decisions on an answer are asked)."""
    return openai.OpenAI(api_key="none", base_url="http://127.0.0.1:9/v1")


def response(error: ApiError) -> httpx2.Response:
    """The HTTP answer http_api.py makes of an ApiError (its status, headers and body)."""
    return httpx2.Response(
        error.status,
        headers=error.headers,
        json=error.body(),
        request=httpx2.Request("POST", URL),
    )


def test_every_code_is_a_grpc_status_of_the_same_name_and_has_an_http_answer():
    assert {c.name for c in Code} <= set(grpc.StatusCode.__members__)
    assert set(HTTP_STATUS) == set(Code) == set(OPENAI)  # (no code falls back to a bare 500)
    assert "OK" not in Code.__members__ and "UNKNOWN" not in Code.__members__


def test_a_gateway_error_keeps_its_code_message_and_retry_hint():
    e = GatewayError(Code.RESOURCE_EXHAUSTED, "quota used up", 1500)
    assert (e.code, e.message, e.retry_after_ms, str(e)) == (
        Code.RESOURCE_EXHAUSTED,
        "quota used up",
        1500,
        "quota used up",
    )
    assert GatewayError(Code.INTERNAL, "x").retry_after_ms is None


@pytest.mark.parametrize("code", list(Code), ids=lambda c: c.name)
def test_each_code_reaches_an_openai_client_as_the_openai_api_answers_it(client, code):
    status, exception, retried = OPENAI[code]
    error = ApiError.of(GatewayError(code, "it went wrong"))
    assert error.status == status
    _, type_, openai_code = HTTP_STATUS[code]
    assert error.body() == {
        "error": {"message": "it went wrong", "type": type_, "param": None, "code": openai_code}
    }
    answer = response(error)
    raised = client._make_status_error("it went wrong", body=error.body(), response=answer)
    assert type(raised) is exception
    assert raised.code == openai_code and raised.type == type_
    assert client._should_retry(answer) is retried
    assert (error.headers.get("x-should-retry") == "false") is (code in NOT_RETRIED)


@pytest.mark.parametrize("code", list(Code), ids=lambda c: c.name)
def test_a_code_answers_alike_whether_the_core_or_the_scheduler_raised_it(code):
    """http_api.py maps the core's GatewayError, and a gRPC status passed on as it is (the
    scheduler's), through the same table: an HTTP client cannot tell them apart."""
    core = ApiError.of(GatewayError(code, "max_tokens: too many", 2500))
    passed_on = ApiError.from_status(grpc.StatusCode[code.name], "max_tokens: too many", 2500)
    assert vars(core) == vars(passed_on)


@pytest.mark.parametrize(
    "retry_after_ms,seconds",
    [(0, "1"), (1, "1"), (999, "1"), (1000, "1"), (1001, "2"), (1500, "2"), (61_000, "61")],
)
def test_a_retry_hint_is_sent_in_whole_seconds_rounded_up_and_to_the_millisecond(
    client, retry_after_ms, seconds
):
    error = ApiError.of(GatewayError(Code.RESOURCE_EXHAUSTED, "wait", retry_after_ms))
    assert error.headers == {"Retry-After": seconds, "retry-after-ms": str(retry_after_ms)}
    # The openai client waits what the millisecond header says (it prefers it).
    waited = client._parse_retry_after_header(httpx2.Headers(error.headers))
    assert waited == pytest.approx(retry_after_ms / 1000)


def test_an_error_without_a_retry_hint_sends_no_retry_headers():
    assert ApiError.of(GatewayError(Code.UNAVAILABLE, "down")).headers == {}
    assert ApiError.of(GatewayError(Code.CANCELLED, "gone")).headers == {"x-should-retry": "false"}


@pytest.mark.parametrize(
    "code,message,param",
    [
        (Code.INVALID_ARGUMENT, "max_tokens: must be in [1, 8]", "max_tokens"),
        (Code.INVALID_ARGUMENT, "tools[0].parameters: not a schema", "tools[0].parameters"),
        (Code.OUT_OF_RANGE, "top_logprobs: at most 20", "top_logprobs"),
        (Code.INVALID_ARGUMENT, "the prompt: is empty", None),  # (words, not a field)
        (Code.INVALID_ARGUMENT, "no field named here", None),
        (Code.PERMISSION_DENIED, "max_tokens: 600 is above this key's cap of 512", None),
        (Code.RESOURCE_EXHAUSTED, "quota: used up", None),
    ],
)
def test_the_field_a_refusal_names_becomes_param_only_on_a_400(code, message, param):
    error = ApiError.of(GatewayError(code, message))
    assert error.param == param and error.message == message
    assert error.body()["error"]["param"] == param


def test_a_grammar_refusal_names_the_http_requests_response_format():
    """An HTTP request's grammar is its response_format: a refusal of it (the core's, or the
    verifier's grammar running past its limits) names that field."""
    error = ApiError.of(GatewayError(Code.INVALID_ARGUMENT, "grammar: json_schema: not JSON"))
    assert error.status == 400 and error.param == "response_format"
    assert error.message == "response_format: json_schema: not JSON"


def test_each_code_ends_a_grpc_call_with_the_status_of_its_name_and_its_retry_trailer():
    """`_abort` on a real grpc.aio server: the client sees the status named as the code, the
    message as its details, and the retry hint (when there is one) as `retry-after-ms`."""

    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name, _, retry = request.decode().partition(" ")
        await _abort(context, GatewayError(Code[name], f"{name}: why", int(retry) or None))

    async def call_each() -> list[tuple[Code, grpc.StatusCode, str, str | None]]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "test.Errors", {"Fail": grpc.unary_unary_rpc_method_handler(fail)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                method = channel.unary_unary("/test.Errors/Fail")
                for i, code in enumerate(Code):
                    retry = 250 * i  # (none for the first: 0 is sent as no hint here)
                    try:
                        await method(f"{code.name} {retry}".encode(), timeout=10)
                    except grpc.aio.AioRpcError as e:
                        trailer = dict(e.trailing_metadata() or ()).get("retry-after-ms")
                        seen.append((code, e.code(), e.details(), trailer))
        finally:
            await server.stop(None)
        return seen

    seen = asyncio.run(call_each())
    assert [code for code, *_ in seen] == list(Code)  # (every call failed)
    for i, (code, status, details, trailer) in enumerate(seen):
        assert status == grpc.StatusCode[code.name]
        assert details == f"{code.name}: why"
        assert trailer == (str(250 * i) if i else None)
