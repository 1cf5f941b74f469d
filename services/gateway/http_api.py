"""The gateway's OpenAI-compatible HTTP API: its routes onto the core's calls (core.py), and
the core's typed errors onto HTTP statuses and OpenAI's error JSON (openai_api.py holds both
shapes, pure). http_server.py serves the routes.

A completion goes down the core's own path, as a gRPC `Generate` does: API keys, quotas,
validation, audit, metrics, tracing and cancel-on-disconnect are the core's. This module maps
the body to the core's request, and its chunks to one JSON body or to server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from aiohttp import web

from ..v1 import generation_pb2
from .audit import Call
from .core import Gateway
from .errors import Code, GatewayError
from .keys import ANONYMOUS, Principal
from .openai_api import (
    CHAT,
    COMPLETIONS,
    HTTP_STATUS,
    INTERNAL,
    ApiError,
    calls_tools,
    parse,
    to_generate,
)
from .openai_responses import Completion

log = logging.getLogger(__name__)

FORWARDED = ("authorization", "traceparent", "tracestate")  # headers the core reads
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# An HTTP status as the error code the same refusal has on the gRPC port (the audit's).
CODE_NAME = {status: code.name for code, (status, _, _) in reversed(HTTP_STATUS.items())}
CODE_NAME[408] = Code.DEADLINE_EXCEEDED.name  # (a body that did not come in time)


class OpenAIHttp:
    """The routes. `core` is the gateway's; `names` the model ids clients may ask for (the
    served model's name first, then configured aliases); at most `max_calls` completions run
    at once (as `max_concurrent_rpcs` caps the gRPC port). `draining`: set by the server's
    drain, when new completions are refused."""

    def __init__(self, core: Gateway, names: list[str], max_body_bytes: int, max_calls: int):
        self.core, self.names = core, names
        self.max_body_bytes, self.max_calls = max_body_bytes, max_calls
        self.created = int(time.time())
        self.calls: set[asyncio.Task] = set()  # completions in flight
        self.draining = False

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", partial(self._complete, kind=COMPLETIONS))
        app.router.add_post("/v1/chat/completions", partial(self._complete, kind=CHAT))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)

    # --- completions --------------------------------------------------------------------------
    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.draining:
            raise ApiError(
                503, "this gateway is draining; retry (another takes it)", code="draining"
            )
        who = ANONYMOUS
        task = asyncio.current_task()
        assert task is not None
        try:
            try:
                # The key first, from the headers: a call without one takes no call slot
                # and has no body read.
                who = await self._authenticate(request)
                if len(self.calls) >= self.max_calls:
                    raise ApiError(
                        429,
                        f"{self.max_calls} calls in flight on this gateway; retry shortly",
                        "rate_limit_error",
                        code="rate_limit_exceeded",
                        headers={"Retry-After": "1"},
                    )
                self.calls.add(task)
                body = await self._body(request, kind, who)
            except ApiError as e:  # (a wrong key, a bad body): audited as on the gRPC port
                call = Call(peer=_peer(request), protocol="http", who=who)
                self.core.calls.refused(call, CODE_NAME.get(e.status, "INVALID_ARGUMENT"))
                raise
            return await self._generate(request, kind, who, body)
        finally:  # (however it ends: a client gone mid-body included)
            self.calls.discard(task)

    async def _body(self, request: web.Request, kind: str, who: Principal):
        """The request body, parsed: read within first_message_timeout_seconds, while it
        counts against its key's calls whose request has not arrived."""
        if request.content_type != "application/json":
            raise ApiError(
                415,
                f"Content-Type must be application/json, got {request.content_type!r}",
                code="unsupported_media_type",
            )
        timeout = self.core.settings.first_message_timeout_seconds
        try:
            with self.core.quotas.awaiting_request(who):
                raw = await asyncio.wait_for(request.read(), timeout)
        except GatewayError as e:
            raise ApiError.of(e) from None
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout:g}s of its headers",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413, f"the body is larger than {self.max_body_bytes} bytes", code="too_large"
            ) from None
        body = parse(kind, raw)
        if body.model not in self.names:
            raise self._no_model(body.model)
        return body

    async def _generate(
        self, request: web.Request, kind: str, who: Principal, body
    ) -> web.StreamResponse:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        asked = to_generate(body)
        token_text = self.core.token_text if asked.logprobs else None
        completion = Completion(
            kind, body.model, include_usage, token_text, tools=calls_tools(asked)
        )
        call = Call(peer=_peer(request), protocol="http")
        self.core.calls.begin(call, _metadata(request))
        output = _Output(partial(self.core.generate, call, asked, who, None))
        left = True  # whether the client left before the end (until the call ends)
        try:
            first = await output.next()  # errors before any output get their HTTP status
            if body.stream:
                response, left = await self._stream(request, completion, first, output)
                return response
            while first is not None:
                completion.add(first)
                first = await output.next()
            left = False
            return web.json_response(completion.response())
        except ApiError:
            left = False
            raise
        finally:
            await output.aclose()
            self.core.calls.ended(call, output.error, client_left=left, reattaches=False)

    async def _stream(
        self,
        request: web.Request,
        completion: Completion,
        chunk: generation_pb2.GenerateResponse | None,
        output: _Output,
    ) -> tuple[web.StreamResponse, bool]:
        """Server-sent events, as OpenAI streams: a JSON chunk per event, then [DONE]; and
        whether the client left first. A write waits while the client does not read, which
        stops the request's read cursor as a gRPC stream's flow control does."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await response.prepare(request)
            if opening := completion.first_chunk(chunk):
                await response.write(_sse(opening))
            try:
                while chunk is not None:
                    for event in completion.chunks(chunk):
                        await response.write(_sse(event))
                    chunk = await output.next()
            except ApiError as e:  # (the status line is sent: the error goes as an event)
                await response.write(_sse(e.body()))
            except ConnectionError:
                raise
            except Exception:  # a bug: the stream still ends as a client can read it
                log.exception("http stream failed", extra={"path": request.path})
                await response.write(_sse(INTERNAL.body()))
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except ConnectionError:
            return response, True
        return response, False

    # --- models, health -----------------------------------------------------------------------
    async def _authenticate(self, request: web.Request) -> Principal:
        try:
            return await self.core.authenticate(dict(_metadata(request)).get("authorization", ""))
        except GatewayError as e:
            raise ApiError.of(e) from None

    def _no_model(self, name: str) -> ApiError:
        served = ", ".join(map(repr, self.names))
        return ApiError(
            404,
            f"the model {name[:100]!r} does not exist; this service serves {served} "
            "(GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specserve"}

    async def _models(self, request: web.Request) -> web.Response:
        await self._authenticate(request)
        return web.json_response({"object": "list", "data": [self._card(n) for n in self.names]})

    async def _model(self, request: web.Request) -> web.Response:
        await self._authenticate(request)
        name = request.match_info["model"]
        if name not in self.names:
            raise self._no_model(name)
        return web.json_response(self._card(name))


class _Output:
    """A call's chunks from the core (started by `start` at the first `next`), its errors as
    the OpenAI API's; `error`: the code of the one that ended it, by name."""

    def __init__(self, start: Callable[[], Awaitable[AsyncIterator]]):
        self._start = start
        self._chunks: AsyncIterator[generation_pb2.GenerateResponse] | None = None
        self.error: str | None = None

    async def next(self) -> generation_pb2.GenerateResponse | None:
        """The next chunk; None at the end; ApiError when the core refused or ended it."""
        try:
            if self._chunks is None:
                self._chunks = await self._start()
            return await anext(self._chunks, None)
        except GatewayError as e:
            self.error = e.code.name
            raise ApiError.of(e) from None

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()


def _metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
    """The headers the core reads, named in lower case (as gRPC metadata is)."""
    return tuple((k.lower(), v) for k, v in request.headers.items() if k.lower() in FORWARDED)


def _peer(request: web.Request) -> str:
    """The client's address, as gRPC names a peer."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if not peer:
        return "unknown"
    host = f"ipv6:[{peer[0]}]" if ":" in peer[0] else f"ipv4:{peer[0]}"
    return f"{host}:{peer[1]}"


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
