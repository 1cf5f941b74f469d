"""The gateway's OpenAI-compatible HTTP API (aiohttp, on the gRPC server's event loop).

A call goes down the same path as a gRPC `Generate`: `HttpContext` gives `GenerationService`
what it asks of a gRPC context (the caller's metadata, `abort`, done callbacks), so API keys,
quotas, validation, audit, metrics, tracing and cancel-on-disconnect are the gRPC port's own.
This module only maps JSON to the request (`openai_api`) and the stream to JSON or SSE.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

import grpc
from aiohttp import web

from ..common import tls
from ..v1 import generation_pb2
from . import metrics
from .audit import Call
from .keys import ANONYMOUS, QuotaExceeded
from .openai_api import (
    CHAT,
    COMPLETIONS,
    HTTP_STATUS,
    ApiError,
    Completion,
    calls_tools,
    parse,
    to_generate,
)

log = logging.getLogger(__name__)

FORWARDED = ("authorization", "traceparent", "tracestate")  # headers the service reads
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
CANCEL_WAIT_SECONDS = 5.0  # a drain waits this long for the calls it cut, and their cancels
INTERNAL = ApiError(500, "internal error", "server_error")
# An HTTP status as the gRPC status name the same refusal has on the gRPC port (the audit's).
GRPC_NAME = {status: code.name for code, (status, _, _) in reversed(HTTP_STATUS.items())}
GRPC_NAME[408] = grpc.StatusCode.DEADLINE_EXCEEDED.name  # (a body that did not come in time)


class Aborted(Exception):
    """`HttpContext.abort`: the service ended the call with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple):
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing

    def api_error(self) -> ApiError:
        retry = dict(self.trailing).get("retry-after-ms")
        return ApiError.from_status(self.code, self.details, int(retry) if retry else None)


class HttpContext:
    """The part of a grpc.aio ServicerContext that `GenerationService` uses, for one HTTP
    request: an HTTP call has no deadline, and it is cancelled when its client disconnects."""

    protocol = "http"  # (in the audit record; an HTTP client cannot re-attach to a stream)

    def __init__(self, request: web.Request):
        self._metadata = tuple(
            (k.lower(), v) for k, v in request.headers.items() if k.lower() in FORWARDED
        )
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer:  # (as gRPC names a peer)
            host = f"ipv6:[{peer[0]}]" if ":" in peer[0] else f"ipv4:{peer[0]}"
            self._peer = f"{host}:{peer[1]}"
        else:
            self._peer = "unknown"
        self._callbacks: list[Callable[[HttpContext], None]] = []
        self._code: grpc.StatusCode | None = None
        self._cancelled = False
        self._trailing: tuple = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, metadata) -> None:
        self._trailing = tuple(metadata)

    def add_done_callback(self, callback: Callable[[HttpContext], None]) -> None:
        self._callbacks.append(callback)

    def cancelled(self) -> bool:
        return self._cancelled

    def code(self) -> grpc.StatusCode | None:
        return self._code

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise Aborted(code, details, self._trailing)

    def done(self, cancelled: bool) -> None:
        """The call is over (`cancelled`: its client left first): the done callbacks run."""
        self._cancelled = cancelled
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class OpenAIHttp:
    """The routes. `service` is the gateway's `GenerationService`; `names` the model ids
    clients may ask for (the served model's name first, then configured aliases); at most
    `max_calls` completions run at once (as `max_concurrent_rpcs` caps the gRPC port)."""

    def __init__(
        self,
        service,
        names: list[str],
        max_body_bytes: int,
        max_calls: int,
        ready: Callable[[], bool],
    ):
        self.service, self.names, self.ready = service, names, ready
        self.max_body_bytes, self.max_calls = max_body_bytes, max_calls
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.calls: set[asyncio.Task] = set()  # completions in flight
        self.draining = False

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", partial(self._complete, kind=COMPLETIONS))
        app.router.add_post("/v1/chat/completions", partial(self._complete, kind=CHAT))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/health", self._health)  # ready to serve (load balancers)
        app.router.add_get("/readyz", self._health)
        app.router.add_get("/livez", self._live)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listens (TLS as the gRPC port does); the port bound."""
        # handler_cancellation: a client that disconnects cancels its handler, so its
        # request is cancelled as a gRPC stream's is.
        self.runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=CANCEL_WAIT_SECONDS,  # (what is left then: idle connections)
        )
        await self.runner.setup()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)  # (port 0: a free one)
        await web.SockSite(self.runner, sock, ssl_context=tls.http_context()).start()
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self, drain_seconds: float) -> None:
        """A drain: new calls get 503 (and /health 503, for the load balancer) while those in
        flight finish, for up to `drain_seconds`; the rest are cut and their requests
        cancelled (an HTTP client cannot re-attach). Then the port closes."""
        self.draining = True
        if self.calls:
            await asyncio.wait(set(self.calls), timeout=drain_seconds)
        for task in self.calls:
            task.cancel()
        if self.calls:
            await asyncio.wait(set(self.calls), timeout=CANCEL_WAIT_SECONDS)
        await self.service.cancels_sent(timeout=CANCEL_WAIT_SECONDS)
        if self.runner is not None:
            await self.runner.cleanup()

    # --- errors -------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error in OpenAI's JSON shape, never a traceback; a response count per route."""
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        try:
            response = await handler(request)
        except ApiError as e:
            response = web.json_response(e.body(), status=e.status, headers=e.headers)
        except ConnectionError:  # the client left (mid-body): nobody reads an answer
            response = web.Response(status=499)
        except web.HTTPException as e:  # no such route, wrong method
            where = f"{e.reason}: {request.method} {request.path[:200]}"
            error = ApiError(e.status, where, code=e.reason.lower().replace(" ", "_"))
            response = web.json_response(error.body(), status=e.status)
        except Exception:
            log.exception("http handler failed", extra={"path": request.path})
            response = web.json_response(INTERNAL.body(), status=500)
        metrics.HTTP_RESPONSES.labels(name, str(response.status)).inc()
        return response

    async def _body(self, request: web.Request, kind: str, who):
        """The request body, parsed: read within first_message_timeout_seconds, while it
        counts against its key's calls whose request has not arrived."""
        if request.content_type != "application/json":
            raise ApiError(
                415,
                f"Content-Type must be application/json, got {request.content_type!r}",
                code="unsupported_media_type",
            )
        timeout = self.service.settings.first_message_timeout_seconds
        try:
            with self.service.awaiting_request(who):
                raw = await asyncio.wait_for(request.read(), timeout)
        except QuotaExceeded as e:
            raise ApiError.from_status(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_ms
            ) from None
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

    def _no_model(self, name: str) -> ApiError:
        served = ", ".join(map(repr, self.names))
        return ApiError(
            404,
            f"the model {name[:100]!r} does not exist; this service serves {served} "
            "(GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    # --- completions --------------------------------------------------------------------------
    async def _complete(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.draining:
            raise ApiError(
                503, "this gateway is draining; retry (another takes it)", code="draining"
            )
        context, who = HttpContext(request), ANONYMOUS
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
                call = Call(peer=context.peer(), protocol=HttpContext.protocol, who=who)
                self.service.refused(call, GRPC_NAME.get(e.status, "INVALID_ARGUMENT"))
                raise
            return await self._generate(request, kind, context, who, body)
        finally:  # (however it ends: a client gone mid-body included)
            self.calls.discard(task)

    async def _generate(
        self, request: web.Request, kind: str, context: HttpContext, who, body
    ) -> web.StreamResponse:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        asked = to_generate(body)
        token_text = self.service.token_text if asked.logprobs else None
        completion = Completion(
            kind, body.model, include_usage, token_text, tools=calls_tools(asked)
        )
        chunks = self.service.Generate(asked, context, who)
        left = True  # whether the client left before the end (until the call ends)
        try:
            first = await _next(chunks)  # errors before any output get their HTTP status
            if body.stream:
                response, left = await self._stream(request, completion, first, chunks)
                return response
            while first is not None:
                completion.add(first)
                first = await _next(chunks)
            left = False
            return web.json_response(completion.response())
        except ApiError:
            left = False
            raise
        finally:
            await chunks.aclose()
            context.done(cancelled=left)

    async def _stream(
        self,
        request: web.Request,
        completion: Completion,
        chunk: generation_pb2.GenerateResponse | None,
        chunks: AsyncIterator[generation_pb2.GenerateResponse],
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
                    chunk = await _next(chunks)
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
    async def _authenticate(self, request: web.Request):
        try:
            return await self.service.authenticate(HttpContext(request))
        except Aborted as e:
            raise e.api_error() from None

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

    async def _health(self, request: web.Request) -> web.Response:
        if self.ready() and not self.draining:
            return web.json_response({"status": "serving"})
        return web.json_response({"status": "not serving"}, status=503)

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})


async def _next(chunks) -> generation_pb2.GenerateResponse | None:
    """The stream's next chunk; None at its end; ApiError when the service aborted it."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except Aborted as e:
        raise e.api_error() from None
