"""Scheduler gRPC service (Submit / Cancel) and the placement loop."""

from __future__ import annotations

import logging
import threading
from collections import deque

import grpc
from google.protobuf import json_format

from ..common.grpc_server import Server
from ..common.settings import SchedulerSettings
from ..common.store import QUEUE_CLASSES, RequestStore
from ..v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from .placement import choose_verifier, parse_verifiers

log = logging.getLogger(__name__)

CLASS_NAMES = {
    common_pb2.PRIORITY_CLASS_INTERACTIVE: "interactive",
    common_pb2.PRIORITY_CLASS_BATCH: "batch",
}


def cancelled_final(prompt_tokens: int) -> dict:
    return {
        "finish_reason": "FINISH_REASON_CANCELLED",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0},
    }


class VerifierClients:
    """One channel per verifier address, reused."""

    def __init__(self):
        self._stubs: dict[str, verifier_pb2_grpc.VerifierStub] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> verifier_pb2_grpc.VerifierStub:
        with self._lock:
            if address not in self._stubs:
                self._stubs[address] = verifier_pb2_grpc.VerifierStub(
                    grpc.insecure_channel(address)
                )
            return self._stubs[address]


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self, settings: SchedulerSettings, store: RequestStore, verifiers: VerifierClients
    ):
        self.settings = settings
        self.store = store
        self.verifiers = verifiers
        self.limits = {
            "interactive": settings.interactive_queue_limit,
            "batch": settings.batch_queue_limit,
        }

    def Submit(self, request: scheduler_pb2.SubmitRequest, context) -> scheduler_pb2.SubmitResponse:
        cls = CLASS_NAMES.get(request.priority)
        if cls is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "priority must be interactive or batch")
        if not request.request_id or not request.prompt_ids or request.max_tokens < 1:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id, prompt_ids and max_tokens >= 1 are required",
            )
        spec = json_format.MessageToDict(request, preserving_proto_field_name=True)
        code, waiting = self.store.create(request.request_id, spec, cls, self.limits[cls])
        if code == 2:
            context.set_trailing_metadata((("retry-after-ms", "1000"),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {cls} queue is full ({waiting} waiting); retry in about a second",
            )
        log.info(
            "submitted",
            extra={
                "request_id": request.request_id,
                "class": cls,
                "existing": code == 1,
                "waiting": waiting,
            },
        )
        return scheduler_pb2.SubmitResponse(existing=code == 1, queue_position=waiting)

    def Cancel(self, request, context) -> scheduler_pb2.SchedulerCancelResponse:
        rec = self.store.get(request.request_id)
        if rec is None:
            return scheduler_pb2.SchedulerCancelResponse(cancelled=False)
        state, owner = self.store.cancel(
            request.request_id, cancelled_final(len(rec.spec.get("prompt_ids", [])))
        )
        if state == 2 and owner:
            address = next(
                (v["address"] for v in self.store.live_verifiers() if v["id"] == owner), None
            )
            if address:
                try:
                    self.verifiers.get(address).Cancel(
                        verifier_pb2.VerifierCancelRequest(request_id=request.request_id),
                        timeout=self.settings.timeout_seconds,
                    )
                except grpc.RpcError as e:  # the verifier also reads the flag each step
                    log.warning("verifier cancel failed", extra={"code": str(e.code())})
        return scheduler_pb2.SchedulerCancelResponse(cancelled=state in (1, 2))


class Placer:
    """Moves queued requests onto verifiers: interactive first, then batch."""

    def __init__(
        self,
        settings: SchedulerSettings,
        store: RequestStore,
        verifiers: VerifierClients,
        consumer: str,
    ):
        self.settings = settings
        self.store = store
        self.verifiers = verifiers
        self.consumer = consumer
        # Entries read from the queues and not yet placed, per class (oldest first).
        self.waiting: dict[str, deque[tuple[str, str]]] = {c: deque() for c in QUEUE_CLASSES}
        self.stop = threading.Event()

    def recover(self) -> None:
        """Entries this consumer read before a restart and never placed are placed again."""
        for cls in QUEUE_CLASSES:
            for entry in self.store.pending_entries(cls, self.consumer):
                self.waiting[cls].append(entry)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                placed = self.place_some()
            except Exception:
                log.exception("placement failed; retrying")
                placed = False
            if not placed:
                self.stop.wait(self.settings.placement_poll_seconds)

    def place_some(self) -> bool:
        loads = parse_verifiers(self.store.live_verifiers())
        placed = False
        for cls in QUEUE_CLASSES:
            while (target := choose_verifier(loads)) is not None:
                if not self.waiting[cls]:
                    self.waiting[cls].extend(self.store.read_queue(cls, self.consumer, 1))
                if not self.waiting[cls]:
                    break
                entry_id, rid = self.waiting[cls][0]
                ok = self._admit(target.address, rid)
                if ok is None:  # verifier refused or failed: treat it as full for now
                    target.running = target.capacity
                    continue
                self.waiting[cls].popleft()  # placed, or no longer waiting (e.g. cancelled)
                if ok:
                    target.running += 1
                    placed = True
        return placed

    def _admit(self, address: str, rid: str) -> bool | None:
        """True if admitted, False if the request no longer needs placing, None to retry."""
        rec = self.store.get(rid)
        if rec is None or rec.status != "queued":
            return False
        try:
            resp = self.verifiers.get(address).Admit(
                verifier_pb2.AdmitRequest(request_id=rid), timeout=self.settings.timeout_seconds
            )
        except grpc.RpcError as e:
            log.warning("admit failed", extra={"verifier": address, "code": str(e.code())})
            return None
        if resp.admitted:
            log.info("placed", extra={"request_id": rid, "verifier": address})
            return True
        rec = self.store.get(rid)
        return False if rec is None or rec.status != "queued" else None


def build(settings: SchedulerSettings):
    store = RequestStore.from_url(settings.redis_url)
    store.ensure_queues()
    clients = VerifierClients()
    server = Server(
        settings.host,
        settings.port,
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
    )
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(
        SchedulerService(settings, store, clients), server.grpc
    )
    placer = Placer(settings, store, clients, consumer="scheduler")
    placer.recover()
    thread = threading.Thread(target=placer.run, name="placement", daemon=True)
    thread.start()
    server.start()
    server.set_serving(True)
    log.info("scheduler ready", extra={"port": server.port})

    def on_stop() -> None:
        placer.stop.set()
        thread.join(timeout=5)

    return server, on_stop
