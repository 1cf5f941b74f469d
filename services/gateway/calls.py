"""A Generate call's life around the core, whichever port it came in on: its span, its
Submit in flight, and its end: the metrics, the cancel of a request nobody will read any
more, then, in order on a thread of their own, the quota release and the audit record.

An edge reports a call's end (`ended`) with what it saw: the error it ended with, whether its
client left first, and whether such a client re-attaches (a gRPC one can, with resume_from;
an HTTP one cannot). A call refused before it reached the core is counted and audited alike
(`refused`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from ..common import telemetry
from ..v1 import scheduler_pb2, scheduler_pb2_grpc
from . import metrics
from .audit import Audit, Call
from .quotas import Quotas
from .streaming import Streams

log = logging.getLogger(__name__)


class Calls:
    """The calls of one gateway. `draining` is set on SIGTERM: a stream cut by the drain is
    not a cancellation (its client re-attaches elsewhere)."""

    def __init__(
        self,
        scheduler: scheduler_pb2_grpc.SchedulerServiceStub,
        timeout_seconds: float,
        quotas: Quotas,
        streams: Streams,
        audit: Audit,
        loop: asyncio.AbstractEventLoop,
    ):
        self.scheduler, self.timeout_seconds = scheduler, timeout_seconds
        self.quotas, self.streams, self.audit, self.loop = quotas, streams, audit, loop
        self.draining = False
        self.settling = ThreadPoolExecutor(1, thread_name_prefix="gateway-settle")
        self._cancels: set[asyncio.Task] = set()  # cancels of requests whose client left
        self._submits: set[asyncio.Future] = set()  # Submits on their way to the scheduler

    def begin(self, call: Call, metadata: Iterable[tuple[str, str]]) -> None:
        """The call's span, a child of the caller's trace (from its headers)."""
        call.span = telemetry.tracer.start_span(
            "gateway.generate", context=telemetry.extract(metadata)
        )
        call.trace_ctx = trace.set_span_in_context(call.span)

    def submit(
        self, call: Call, submit: scheduler_pb2.SubmitRequest, timeout: float
    ) -> asyncio.Future:
        """Sends the request to the scheduler, waiting out a restarting one (within
        `timeout`; Submit is idempotent). It is not cut short when the client leaves: the
        request it may create is cancelled once it is known to exist (`ended`), never left
        to run for nobody."""
        call.submitted = asyncio.ensure_future(
            self.scheduler.Submit(
                submit,
                timeout=timeout,
                wait_for_ready=True,
                metadata=telemetry.inject(call.trace_ctx),
            )
        )
        self._submits.add(call.submitted)
        call.submitted.add_done_callback(self._submits.discard)
        call.submitted.add_done_callback(_settled)
        return call.submitted

    def ended(self, call: Call, error: str | None, client_left: bool, reattaches: bool) -> None:
        """When the call ends, however (on the event loop): the metrics; then, on a thread,
        the stream slot and unused tokens go back, a request whose client left before the
        end is cancelled, and the call is audited. `error`: the name of the error code it
        ended with, if any; `reattaches`: a client this gateway cuts (a drain, a Redis
        outage) re-attaches."""
        status = call.finish or error or "CANCELLED"
        if client_left and not call.finish:
            status = "CANCELLED"
        record = call.record(status)
        pool = call.pool or "none"
        metrics.REQUESTS.labels(call.priority or "unknown", status, pool).inc()
        if call.first_token_at and not call.resumed:
            metrics.TTFT.labels(call.priority, pool).observe(call.first_token_at - call.started)
        if call.emitted > 1 and not call.resumed:
            per_token = (time.monotonic() - call.first_token_at) / (call.emitted - 1)
            metrics.TPOT.labels(call.priority, pool).observe(per_token)
        if call.streaming:
            metrics.OPEN_STREAMS.dec()
        self.quotas.stream_closed(call)
        call.span.set_attributes({k: v for k, v in record.items() if k != "client"})
        call.span.end()
        if not call.finish and not (reattaches and (self.draining or call.told_to_reattach)):
            # Nobody will read the rest. (A gRPC client cut by a drain, or told to re-attach
            # after a Redis outage, re-attaches; an HTTP client cannot.)
            submitted = call.submitted
            if submitted is not None and not submitted.done():  # (it may yet create one)
                submitted.add_done_callback(lambda f: self._cancel_soon(call, f))
            elif call.streaming or submitted is not None:
                self._cancel_soon(call, submitted)
        self._settle_soon(call, record)

    def refused(self, call: Call, status: str) -> None:
        """A call refused before it reached the core (gRPC: at its headers, or while its
        request did not come; HTTP: a wrong key, a bad body): counted and audited as `ended`
        does a refused Generate."""
        metrics.REQUESTS.labels("unknown", status, "none").inc()
        self._settle_soon(call, call.record(status))

    def _cancel_soon(self, call: Call, submitted: asyncio.Future | None) -> None:
        """Cancels the request of a call whose client left, if its Submit (when given) created
        it and no other call on this gateway streams it (a client's retry that attached
        meanwhile). The call's own stream may not have closed yet: the RPC's done callback can
        run before its generator's `finally`."""
        if submitted is not None and (submitted.cancelled() or submitted.exception()):
            return
        if self.streams.read_by_another(call):
            return
        task = self.loop.create_task(self._cancel_quietly(call.rid))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel_quietly(self, rid: str) -> None:
        try:
            await self.scheduler.Cancel(
                scheduler_pb2.SchedulerServiceCancelRequest(request_id=rid),
                timeout=self.timeout_seconds,
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            log.warning(
                "cancel after disconnect failed", extra={"request_id": rid, "code": str(e.code())}
            )

    async def cancels_sent(self, timeout: float) -> None:
        """Waits (up to `timeout`) for the cancels of requests whose client left to go out
        (a drain that cuts HTTP streams makes some just before the loop stops)."""
        deadline = time.monotonic() + timeout
        for pending in (self._submits, self._cancels):  # (a Submit that lands makes a cancel)
            if pending and (left := deadline - time.monotonic()) > 0:
                await asyncio.wait(list(pending), timeout=left)

    def _settle_soon(self, call: Call, record: dict) -> None:
        """The quota release and the audit record, in order, on one thread of their own:
        thousands of streams ending at once wake one thread, not the whole pool at once
        (whose threads then take turns at the interpreter lock with the event loop)."""
        try:
            self.settling.submit(self._settle, call, record)
        except RuntimeError:  # the process is exiting (the pool is shut): settle it here
            self._settle(call, record)

    def _settle(self, call: Call, record: dict) -> None:
        self.quotas.release(call)
        self.audit.write(record)


def _settled(submitted: asyncio.Future) -> None:
    """A Submit's end, read (so that a failure nobody awaited is not reported as lost)."""
    if not submitted.cancelled():
        submitted.exception()
