"""gRPC server scaffolding shared by every service: health, reflection, graceful drain."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Gauge

from . import tls

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
# Connection limits of a public port (clients outside the cluster). Keepalive: the server
# pings a connection that went silent each minute and closes it when no answer comes in 20 s
# (a client that vanished holds nothing); a client may ping at most every 5 min without
# calls in flight (more, twice, and it is sent GOAWAY). A connection with no call for 5 min
# is closed; every 30 min a connection is told to go (GOAWAY) so that clients spread over
# gateways as they scale: the calls in flight on it run to their end (no grace limit: a
# stream may run for minutes).
PUBLIC_OPTIONS = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 300_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.max_connection_age_ms", 1_800_000),
]
T = TypeVar("T")


def retrying_channel(address: str, service: str, aio: bool = False) -> grpc.Channel:
    """A channel whose calls to `service` (whose methods must all be idempotent) are retried
    on UNAVAILABLE with exponential backoff by gRPC itself. Streams that already delivered a
    response are never retried (gRPC commits a call once data arrives). With `aio`, a
    grpc.aio channel (create it on its event loop)."""
    config = {
        "methodConfig": [
            {
                "name": [{"service": service}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
    options = [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]
    peer = service.rsplit(".", 1)[-1].removesuffix("Service").lower()  # e.g. "scheduler"
    return (tls.aio_channel if aio else tls.channel)(address, peer, options)


def backlog_options(max_concurrent_rpcs: int | None) -> list[tuple[str, int]]:
    """Server options that let a burst of up to `max_concurrent_rpcs` new calls wait for the
    event loop to take them. Calls that arrive faster than a grpc.aio server's loop asks for
    them wait in C-core's backlog, and past 1,000 waiting (its default) C-core refuses them at
    random: the client gets CANCELLED, with no hint to retry. That happens when thousands of
    clients open or re-attach their streams at once, as after a gateway restarts, and it cut
    some 10% of 2,000 streams opened together. With this, only a backlog of more calls than
    the server may run at once is refused; calls taken past `max_concurrent_rpcs` in flight
    get RESOURCE_EXHAUSTED."""
    if max_concurrent_rpcs is None:
        return []
    return [
        ("grpc.server.max_pending_requests", max_concurrent_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", max_concurrent_rpcs),
    ]


LOOP_TIMEOUT_SECONDS = 5.0  # an event loop that takes longer to run a no-op is stuck
READINESS = Gauge(
    "specserve_readiness_check_passing",
    "1 while a readiness check of this process passes, 0 while it fails (check: e.g. "
    "'redis reachable').",
    ["check"],
)


class _Serving:
    """What both servers share: readiness from checks, stopping on a failure or a signal."""

    def __init__(self, service_names: Iterable[str]):
        self.service_names = list(service_names)
        self.serving = False  # as health reports it
        self.last_beat: float | None = None  # monotonic time of the readiness loop's last pass
        self.ports: dict[str, int] = {}  # more ports it serves, by name (for its ready line)
        self.stopped = threading.Event()
        self.failure: str | None = None  # why the server stopped itself (fail), if it did

    def set_serving(self, serving: bool) -> None:
        raise NotImplementedError

    def _stop_grpc(self, drain_seconds: float) -> None:
        raise NotImplementedError

    def watch(
        self,
        checks: dict[str, Callable[[], bool]],
        period: float = 1.0,
        liveness: dict[str, Callable[[], bool]] | None = None,
    ) -> None:
        """Keeps health true to readiness until the server stops: SERVING while every check
        passes, NOT_SERVING while any fails (each change logged with the failing checks), and
        each check's `specserve_readiness_check_passing`. `liveness` checks (of this process
        alone: never of Redis or another service) are also readiness checks, and while one
        fails the loop stops beating `last_beat`, which the probe port's liveness reads: the
        kubelet restarts a process whose loop or engine is stuck or broken."""
        alive = {**self._liveness(), **(liveness or {})}

        def run() -> None:
            failing: list[str] | None = None
            while not self.stopped.is_set():
                now = [name for name, check in alive.items() if not _passes(check)]
                if not now:  # (first: a slow readiness check must not hold the beat back)
                    self.last_beat = time.monotonic()
                now += [name for name, check in checks.items() if not _passes(check)]
                for name in [*alive, *checks]:
                    READINESS.labels(name).set(0 if name in now else 1)
                if now != failing and not self.stopped.is_set():
                    self.set_serving(not now)
                    if now:
                        log.warning("not serving", extra={"failing": now})
                    elif failing is not None:
                        log.info("serving again")
                    failing = now
                self.stopped.wait(period)

        threading.Thread(target=run, name="health", daemon=True).start()

    def _liveness(self) -> dict[str, Callable[[], bool]]:
        """Liveness checks every server of this kind has."""
        return {}

    def fail(self, reason: str) -> None:
        """Stops the server as a signal would, from a failure it cannot serve past (the
        process then exits non-zero, for whatever supervises it to start it again)."""
        if self.failure is not None:
            return
        log.error("stopping: cannot go on serving", extra={"reason": reason})
        self.failure = reason
        self.set_serving(False)
        self.stopped.set()

    def run_until_signal(self, drain_seconds: float, on_stop: Callable[[], None] = lambda: None):
        """Serves until SIGTERM/SIGINT, then reports NOT_SERVING and drains in-flight RPCs."""

        def _stop(signum, _frame):
            log.info("signal received, draining", extra={"signal": signum})
            self.stopped.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        # A wait with a timeout: Python runs a signal's handler in the main thread, and a main
        # thread blocked in Event.wait() wakes only if the kernel delivered the signal to it;
        # delivered to one of the gRPC threads, a SIGTERM went unhandled and the process
        # served on (a gateway did not drain in 60 s under test).
        while not self.stopped.wait(0.2):
            pass
        self.set_serving(False)
        on_stop()
        self._stop_grpc(drain_seconds)
        log.info("stopped")


class Server(_Serving):
    """A gRPC server with grpc.health.v1 and reflection for the given services, on TLS as
    `tls` was configured (mTLS, or server-only TLS when `public`).

    `service_names` are full proto names (e.g. "specserve.v1.GenerationService"); health reports
    each of them and "" (the whole server). Readiness is set with `set_serving`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        max_workers: int = 32,
        max_concurrent_rpcs: int | None = None,
        public: bool = False,
        callers: dict[str, frozenset[str]] | None = None,
    ):
        """`callers`: which services may call which method (tls.Authorizer), under mTLS."""
        super().__init__(service_names)
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=OPTIONS,
            interceptors=tls.authorizers(callers, public),
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc
        )
        self.port = tls.add_port(self.grpc, f"{host}:{port}", public)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {host}:{port}")
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        self.serving = serving
        for name in ["", *self.service_names]:
            self.health.set(name, _status(serving))

    def start(self) -> None:
        self.grpc.start()

    def _stop_grpc(self, drain_seconds: float) -> None:
        self.grpc.stop(drain_seconds).wait()


class AioServer(_Serving):
    """Server on grpc.aio: the same health, reflection, TLS, readiness and drain, with the
    RPCs as coroutines on one event loop in a thread of its own (`loop`): an open stream
    holds no thread. Handlers run blocking work with `loop.run_in_executor`."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        max_concurrent_rpcs: int | None = None,
        public: bool = False,
    ):
        super().__init__(service_names)
        # Drains run beside the gRPC server's on a stop, with the same grace period.
        self.drains: list[Callable[[float], Coroutine[Any, Any, None]]] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True).start()

        async def make() -> grpc.aio.Server:
            options = OPTIONS + backlog_options(max_concurrent_rpcs)
            options += PUBLIC_OPTIONS if public else []
            server = grpc.aio.server(maximum_concurrent_rpcs=max_concurrent_rpcs, options=options)
            self.health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
            )
            return server

        self.grpc = self.run(make())
        self.port = tls.add_port(self.grpc, f"{host}:{port}", public)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {host}:{port}")
        self.set_serving(False)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs a coroutine on the server's loop, from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _liveness(self) -> dict[str, Callable[[], bool]]:
        def responds() -> bool:  # (every open stream is a coroutine on this one loop)
            self.run(asyncio.sleep(0), timeout=LOOP_TIMEOUT_SECONDS)
            return True

        return {"event loop responding": responds}

    def set_serving(self, serving: bool) -> None:
        self.serving = serving

        async def set_all() -> None:
            for name in ["", *self.service_names]:
                await self.health.set(name, _status(serving))

        self.run(set_all())

    def start(self) -> None:
        self.run(self.grpc.start())

    def _stop_grpc(self, drain_seconds: float) -> None:
        async def stop_all() -> None:
            await asyncio.gather(
                self.grpc.stop(drain_seconds), *(drain(drain_seconds) for drain in self.drains)
            )

        self.run(stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)


def _status(serving: bool) -> int:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


def _passes(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False
