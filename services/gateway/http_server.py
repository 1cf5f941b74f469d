"""The aiohttp server the HTTP API's routes (http_api.py) run in, on the gRPC server's event
loop: listening (TLS as the gRPC port does), health for load balancers, every error answered
in OpenAI's JSON shape (a response count per route), and a drain.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from aiohttp import web

from ..common import tls
from . import metrics
from .http_api import OpenAIHttp
from .openai_api import INTERNAL, ApiError

log = logging.getLogger(__name__)

CANCEL_WAIT_SECONDS = 5.0  # a drain waits this long for the calls it cut, and their cancels


class HttpServer:
    """Serves `api`'s routes; `ready` says whether the gateway serves (its health)."""

    def __init__(self, api: OpenAIHttp, ready: Callable[[], bool]):
        self.api, self.ready = api, ready
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.api.max_body_bytes, middlewares=[errors])
        self.api.add_routes(app)
        app.router.add_get("/health", self._health)  # ready to serve (load balancers)
        app.router.add_get("/readyz", self._health)
        app.router.add_get("/livez", self._live)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listens; the port bound."""
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
        calls = self.api.calls
        self.api.draining = True
        if calls:
            await asyncio.wait(set(calls), timeout=drain_seconds)
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(set(calls), timeout=CANCEL_WAIT_SECONDS)
        await self.api.core.calls.cancels_sent(timeout=CANCEL_WAIT_SECONDS)
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        if self.ready() and not self.api.draining:
            return web.json_response({"status": "serving"})
        return web.json_response({"status": "not serving"}, status=503)

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
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
