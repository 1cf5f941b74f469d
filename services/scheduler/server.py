"""Scheduler gRPC service (Submit / Cancel) and the placement loop."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections import Counter, deque

import grpc
import redis

from ..common import telemetry
from ..common.capacity import kv_fit_problem
from ..common.grpc_server import Server, retrying_channel
from ..common.outage import REDIS_ERRORS, REDIS_UNREACHABLE, OutageLog
from ..common.pools import POOLS, choose_pool
from ..common.settings import SchedulerSettings
from ..store import (
    QUEUE_CLASSES,
    STORED_BYTES_PER_TOKEN,
    RequestRecord,
    RequestStore,
    now_ms,
    spec_json,
)
from ..v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from . import metrics
from .placement import (
    VerifierLoad,
    Want,
    choose_verifier,
    class_order,
    parse_verifiers,
    tenant_cap,
    under_cap,
)
from .recovery import Recovery

log = logging.getLogger(__name__)

VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name

CLASS_NAMES = {
    common_pb2.PRIORITY_CLASS_INTERACTIVE: "interactive",
    common_pb2.PRIORITY_CLASS_BATCH: "batch",
}


FULL_RETRY_MS = 30_000  # when to retry a request refused for Redis's memory
EXPIRY_PERIOD_SECONDS = 0.5  # expiry of waiting requests, and the orphan check
RECLAIM_PERIOD_SECONDS = 5.0
EXPIRY_SCAN = 1000  # queue entries looked at per class and scan (running ones included)
FAIR_WINDOW = 256  # waiting entries per class read ahead past tenants at their slot cap


def ended_final(reason: str, prompt_tokens: int, error: str = "", generated: int = 0) -> dict:
    """FinalInfo (JSON) of a request that ends while queued (after `generated` tokens)."""
    return {
        "finish_reason": reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated},
        "error": error,
    }


def fingerprint(request: scheduler_pb2.SubmitRequest) -> str:
    """What a request asks for, hashed: its resubmission (a gateway retrying Submit, a client
    retrying without resume_from) matches, another request under the same id does not. The
    deadline and the trace are an attempt's own, so they are left out."""
    asked = scheduler_pb2.SubmitRequest()
    asked.CopyFrom(request)
    asked.ClearField("deadline_unix_ms")
    asked.ClearField("traceparent")
    return hashlib.sha256(asked.SerializeToString(deterministic=True)).hexdigest()[:32]


class VerifierClients:
    """One channel per verifier address, reused; UNAVAILABLE is retried with backoff (Admit,
    Cancel and Status are idempotent)."""

    def __init__(self):
        self._stubs: dict[str, verifier_pb2_grpc.VerifierServiceStub] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> verifier_pb2_grpc.VerifierServiceStub:
        with self._lock:
            if address not in self._stubs:
                self._stubs[address] = verifier_pb2_grpc.VerifierServiceStub(
                    retrying_channel(address, VERIFIER_SERVICE)
                )
            return self._stubs[address]


def callers(service: str) -> dict[str, frozenset[str]]:
    """Who may call the scheduler (under mTLS): the gateway, and an operator's client (the
    rollout probe); a verifier's or a drafter's certificate submits nothing."""
    return {f"/{service}/": frozenset({"gateway", "client"})}


class SchedulerService(scheduler_pb2_grpc.SchedulerServiceServicer):
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
        parent = telemetry.extract(context.invocation_metadata())
        with telemetry.tracer.start_as_current_span("scheduler.submit", context=parent) as span:
            request.traceparent = telemetry.traceparent()  # the trace goes on through Redis
            response = self._submit(request, context)
            span.set_attributes({"existing": response.existing, "waiting": response.queue_position})
            return response

    def _submit(self, request, context) -> scheduler_pb2.SubmitResponse:
        cls = CLASS_NAMES.get(request.priority)
        if cls is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "priority must be interactive or batch")
        if request.pool and request.pool not in POOLS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"pool must be one of {', '.join(POOLS)} or empty"
            )
        if not request.request_id or not request.prompt_ids or request.max_tokens < 1:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id, prompt_ids and max_tokens >= 1 are required",
            )
        spec = spec_json(request)  # (as the store keeps it)
        try:
            if not self.store.exists(request.request_id):  # (a retry is never refused here)
                self._check_room(request, context, cls)
            code, waiting = self.store.create(
                request.request_id, spec, cls, self.limits[cls], fingerprint(request)
            )
        except redis.exceptions.OutOfMemoryError:
            self._refuse_full(context, cls, "Redis is out of memory")
        except REDIS_ERRORS as e:  # not acknowledged: the client retries (Submit is idempotent)
            log.warning(
                "submit not stored", extra={"request_id": request.request_id, "error": str(e)}
            )
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request state is unavailable ({e})")
        if code == 2:
            metrics.REJECTED.labels(cls).inc()
            context.set_trailing_metadata((("retry-after-ms", "1000"),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {cls} queue is full ({waiting} waiting); retry in about a second",
            )
        if code == 3:
            metrics.REJECTED.labels(cls).inc()
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                "request_id: taken by a different request (another prompt or other "
                "parameters); send a new request_id, or resume_from to re-attach to that one",
            )
        if code == 0:
            metrics.SUBMITTED.labels(cls).inc()
            if request.tenant:
                self._count_stored(request, len(spec))
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

    def _check_room(self, request, context, cls: str) -> None:
        """RESOURCE_EXHAUSTED for a new request while Redis is nearly full, or while its
        tenant's requests of the last hour hold its cap of Redis."""
        if (full := self.store.memory_fraction()) > self.settings.redis_memory_admit_fraction:
            self._refuse_full(context, cls, f"Redis holds {full:.0%} of its maxmemory")
        cap = self.settings.tenant_stored_bytes_limit
        if request.tenant and cap and (held := self.store.stored_bytes(request.tenant)) > cap:
            self._refuse_full(
                context,
                cls,
                f"tenant {request.tenant}'s requests of the last hour hold about {held} bytes "
                f"of Redis, past its cap of {cap}",
            )

    def _count_stored(self, request, spec_bytes: int) -> None:
        """Adds what a request it created stores to its tenant's count (best effort: a
        request is never refused for its count)."""
        nbytes = spec_bytes + STORED_BYTES_PER_TOKEN * request.max_tokens
        try:
            self.store.add_stored_bytes(request.tenant, nbytes)
        except REDIS_ERRORS as e:
            log.warning(
                "stored bytes not counted", extra={"tenant": request.tenant, "error": str(e)}
            )

    @staticmethod
    def _refuse_full(context, cls: str, why: str) -> None:
        """RESOURCE_EXHAUSTED for a request Redis has no room for (or its tenant no share)."""
        metrics.REJECTED.labels(cls).inc()
        context.set_trailing_metadata((("retry-after-ms", str(FULL_RETRY_MS)),))
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{why}: new requests wait for ended ones to expire (the requests running go on); "
            f"retry in {FULL_RETRY_MS // 1000}s",
        )

    def Cancel(self, request, context) -> scheduler_pb2.SchedulerServiceCancelResponse:
        try:
            rec = self.store.get(request.request_id)
            if rec is None:
                return scheduler_pb2.SchedulerServiceCancelResponse(cancelled=False)
            state, owner = self.store.cancel(
                request.request_id,
                ended_final("FINISH_REASON_CANCELLED", len(rec.request.prompt_ids)),
            )
        except REDIS_ERRORS as e:  # (Cancel is idempotent: the caller retries)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request state is unavailable ({e})")
        if state == 2 and owner:
            address = next(
                (v["address"] for v in self.store.live_verifiers() if v["id"] == owner), None
            )
            if address:
                try:
                    self.verifiers.get(address).Cancel(
                        verifier_pb2.VerifierServiceCancelRequest(request_id=request.request_id),
                        timeout=self.settings.timeout_seconds,
                    )
                except grpc.RpcError as e:  # the verifier also reads the flag each step
                    log.warning("verifier cancel failed", extra={"code": str(e.code())})
        return scheduler_pb2.SchedulerServiceCancelResponse(cancelled=state in (1, 2))


class Placer:
    """Moves queued requests onto verifiers, interactive first (see `class_order`), a new
    request into the rollout pool its id falls in and a requeued one back onto its model
    version; ends requests that waited past their class timeout or deadline; requeues the
    running requests their verifier does not run (`Recovery`); takes over queue entries
    another scheduler read and left."""

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
        self.timeouts = {
            "interactive": settings.interactive_queue_timeout_seconds,
            "batch": settings.batch_queue_timeout_seconds,
        }
        # Entries read from the queues and not yet placed, per class (oldest first).
        self.waiting: dict[str, deque[tuple[str, str]]] = {c: deque() for c in QUEUE_CLASSES}
        self.streak = 0  # interactive placements in a row while batch work waited
        self.recovery = Recovery(settings, store)
        # Requeued requests whose model version no live verifier serves: request id ->
        # (class, queue entry, version, since when). They wait aside: their class goes on.
        self.parked: dict[str, tuple[str, tuple[str, str], str, float]] = {}
        self.canary_share: float | None = None  # this pass's rollout share (see _pin)
        self.tenant_of: dict[str, str] = {}  # request id -> tenant (waiting and running)
        self.held: Counter[str] | None = None  # slots per tenant, this pass (see _slots_held)
        self.running_ids: set[str] = set()  # requests running at the last count
        self._next_expiry = 0.0
        self._next_reclaim = 0.0
        self.stop = threading.Event()

    def recover(self) -> None:
        """Entries this consumer read before a restart and never placed are placed again."""
        for cls in QUEUE_CLASSES:
            self._add_waiting(cls, self.store.pending_entries(cls, self.consumer))

    def _add_waiting(self, cls: str, entries: list[tuple[str, str]], first: bool = False) -> int:
        """Adds queue entries not waiting yet, at the back (or `first`, in their order);
        returns how many."""
        known = set(self.waiting[cls])  # (entry id, request id): ids of two shards may meet
        new = [e for e in entries if e not in known]
        if first:
            self.waiting[cls].extendleft(reversed(new))
        else:
            self.waiting[cls].extend(new)
        return len(new)

    def run(self) -> None:
        outage = OutageLog(log, "placement")  # a Redis outage: a line as it starts and ends
        while not self.stop.is_set():
            try:
                now = time.monotonic()
                if now >= self._next_reclaim:
                    self.reclaim()
                    self._next_reclaim = now + RECLAIM_PERIOD_SECONDS
                if now >= self._next_expiry:
                    self.expire_waiting()
                    self.recovery.run()
                    self.take_requeued()
                    self.unpark()
                    self._next_expiry = now + EXPIRY_PERIOD_SECONDS
                placed = self.place_some()
            except REDIS_UNREACHABLE as e:
                outage.failed(e)
                placed = False
            except Exception:
                log.exception("placement failed; retrying")
                placed = False
            else:
                outage.succeeded()
            if not placed:
                self.stop.wait(self.settings.placement_poll_seconds)

    def take_requeued(self) -> None:
        """Requests put back in their queue (by this loop, or by a draining verifier) are
        placed ahead of their class: they waited their turn once already."""
        for cls in QUEUE_CLASSES:
            self._add_waiting(cls, self.store.take_requeued(cls), first=True)

    def unpark(self) -> None:
        """Parked requests go back to the head of their class once a verifier of their
        version is live; past `version_wait_seconds` they fail (they cannot go on elsewhere
        without mixing versions in one stream)."""
        metrics.PARKED.set(len(self.parked))
        if not self.parked:
            return
        live = {v.get("version", "") for v in self.store.live_verifiers()}
        now = time.monotonic()
        for rid, (cls, entry, version, since) in list(self.parked.items()):
            rec = self.store.get(rid)
            if rec is None or rec.status != "queued":
                del self.parked[rid]
            elif version in live:
                del self.parked[rid]
                self._add_waiting(cls, [entry], first=True)
            elif now - since > self.settings.version_wait_seconds:
                del self.parked[rid]
                why = (
                    f"model version {version}, which generated its first {rec.generated} tokens, "
                    f"is no longer served; retry the request"
                )
                self._end(rec, cls, why)
        metrics.PARKED.set(len(self.parked))

    def reclaim(self) -> None:
        """Takes over the entries other placement consumers read and left idle (a scheduler
        that died): the queued ones among them wait here now."""
        idle_ms = int(self.settings.reclaim_idle_seconds * 1000)
        for cls in QUEUE_CLASSES:
            entries = self.store.reclaim(cls, self.consumer, idle_ms)
            known = set(self.waiting[cls])  # waiting here already: no lookup
            queued = [
                e
                for e in entries
                if e not in known and getattr(self.store.get(e[1]), "status", "") == "queued"
            ]
            if added := self._add_waiting(cls, queued):
                metrics.RECLAIMED.inc(added)
                log.info("reclaimed", extra={"class": cls, "entries": added})

    def place_some(self) -> bool:
        """Places waiting requests until none fits; True if any was placed."""
        rows = self.store.live_verifiers()
        loads = parse_verifiers([v for v in rows if not self.recovery.restarted(v)])
        self.canary_share = None  # read once per pass, when a request first needs it
        self.held = None  # read once per pass, when a request of a tenant first needs it
        placed, blocked = False, set()
        if not loads:
            blocked.update(QUEUE_CLASSES)
        while len(blocked) < len(QUEUE_CLASSES):
            batch_waiting = "batch" not in blocked and self._head("batch") is not None
            for cls in class_order(self.streak, self.settings.interactive_burst, batch_waiting):
                if cls not in blocked:
                    break
            if not self._place_head(cls, loads):
                blocked.add(cls)
                continue
            placed = True
            if cls == "batch":
                self.streak = 0
            elif batch_waiting:
                self.streak += 1
        for cls in QUEUE_CLASSES:
            metrics.QUEUE_DEPTH.labels(cls).set(self.store.waiting_count(cls))
        return placed

    def _head(self, cls: str) -> tuple[str, str] | None:
        if not self.waiting[cls]:
            self._add_waiting(cls, self.store.read_queue(cls, self.consumer, 1))
        return self.waiting[cls][0] if self.waiting[cls] else None

    def _next(
        self, cls: str, loads: list[VerifierLoad]
    ) -> tuple[tuple[str, str], RequestRecord] | None:
        """The oldest waiting request of `cls` whose tenant holds fewer slots than its cap
        (`tenant_slot_share`), with its record; drops requests that ended meanwhile. Past
        requests of tenants at their cap it reads further into the queue, up to FAIR_WINDOW
        waiting, so one tenant's backlog never blocks another's requests."""
        cap = tenant_cap(loads, self.settings.tenant_slot_share)
        while True:
            for entry in list(self.waiting[cls]):
                tenant = self.tenant_of.get(entry[1])
                if tenant and not under_cap(tenant, self._slots_held(loads), cap):
                    continue  # (known to be capped: no lookup)
                rec = self.store.get(entry[1])
                if rec is None or rec.status != "queued":
                    self.waiting[cls].remove(entry)  # cancelled or expired meanwhile
                    continue
                tenant = self.tenant_of.setdefault(entry[1], rec.request.tenant)
                if not tenant or under_cap(tenant, self._slots_held(loads), cap):
                    return entry, rec
            room = FAIR_WINDOW - len(self.waiting[cls])
            if room <= 0:
                return None
            count = room if self.waiting[cls] else 1  # (all capped: read ahead)
            if not self._add_waiting(cls, self.store.read_queue(cls, self.consumer, count)):
                return None

    def _slots_held(self, loads: list[VerifierLoad]) -> Counter[str]:
        """Slots each tenant holds on the live verifiers: their running requests as Redis
        lists them (claimed in Admit, so exact at each pass), counted by tenant."""
        if self.held is None:
            running = self.store.running_on([v.verifier_id for v in loads])
            unknown = [rid for rid in running if rid not in self.tenant_of]
            self.tenant_of.update(self.store.tenants(unknown))
            self.held = Counter(self.tenant_of[rid] for rid in running if self.tenant_of[rid])
            self.running_ids = running
        return self.held

    def _place_head(self, cls: str, loads: list[VerifierLoad]) -> bool:
        """Places the next waiting request of `cls` (`_next`); False if there is none or it
        fits on no verifier now."""
        while (found := self._next(cls, loads)) is not None:
            head, rec = found
            req = rec.request
            deadline = req.deadline_unix_ms
            if deadline and deadline <= now_ms():
                self._expire(rec.request_id, cls, "the deadline passed while it was queued")
                continue
            session = req.session_id
            want = Want(
                cls,
                len(req.prompt_ids),
                req.max_tokens,
                self.store.session_owner(session) if session else None,
                prompt_ids=list(req.prompt_ids),
                prefix_scope=req.prefix_scope,  # (the gateway's choice)
            )
            self._pin(want, rec, {v.pool for v in loads})
            eligible = want.eligible(loads)
            if not eligible:
                if want.version:  # it started on a version no live verifier serves now
                    self.waiting[cls].remove(head)
                    parked = (cls, head, want.version, time.monotonic())
                    self.parked.setdefault(rec.request_id, parked)  # (or parked before)
                    continue
                if req.pool:
                    self._end(rec, cls, f"no live verifier in the {want.pool} pool")
                    continue
                return False  # its pool (by the rollout share) is down: the class waits
            if not any(v.could_ever_hold(want) for v in eligible):
                self._fail(rec, cls, eligible)  # it would block its class until it times out
                continue
            result = None
            candidates = eligible
            trace_ctx = telemetry.from_traceparent(req.traceparent)
            while result is None:
                target = choose_verifier(candidates, want)
                if target is None:
                    return False  # fits nowhere now: the class waits (first in, first out)
                result = self._admit(target, rec.request_id, trace_ctx)
                # refused or failed: full for this request for now
                candidates = [v for v in candidates if v is not target]
            self.waiting[cls].remove(head)
            if result:
                queued = telemetry.tracer.start_span(
                    "scheduler.queue", context=trace_ctx, start_time=rec.created_ms * 1_000_000
                )
                queued.set_attributes({"class": cls, "requeues": rec.requeues})
                queued.end()
                metrics.PREFIX_PLACED.inc(target.cached_blocks(want) > 0)
                target.take(want)
                if self.held is not None and (tenant := req.tenant):
                    self.held[tenant] += 1
                metrics.PLACED.labels(cls, target.pool).inc()
                metrics.QUEUE_WAIT.labels(cls).observe(max(0, now_ms() - rec.created_ms) / 1e3)
                metrics.SESSION_HITS.inc(target.verifier_id == want.session_owner)
                return True
        return False

    def _pin(self, want: Want, rec, live_pools: set[str]) -> None:
        """A request that has generated tokens continues on the model version that made them
        (in any pool); a probe runs in the pool it names; any other request runs in the pool
        its id falls in."""
        if rec.generated and rec.version:
            want.version = rec.version
        elif rec.request.pool:
            want.pool = rec.request.pool
        else:
            if self.canary_share is None:
                self.canary_share = self.store.rollout()["canary_share"]
                metrics.CANARY_SHARE.set(self.canary_share)
            want.pool = choose_pool(rec.request_id, self.canary_share, live_pools)

    def expire_waiting(self) -> None:
        """Ends queued requests past their class timeout, and any whose deadline passed."""
        now = now_ms()
        for cls in QUEUE_CLASSES:
            timeout_ms = int(self.timeouts[cls] * 1000)
            for rid in self.store.queued_before(cls, now - timeout_ms, EXPIRY_SCAN):
                self._expire(rid, cls, f"waited in the {cls} queue past {self.timeouts[cls]:g}s")
            for entry in list(self.waiting[cls]):
                rec = self.store.get(entry[1])
                if rec is None or rec.status != "queued":
                    self.waiting[cls].remove(entry)  # ended (behind a capped tenant's)
                    continue
                deadline = rec.request.deadline_unix_ms
                if deadline and deadline <= now:
                    self._expire(entry[1], cls, "the deadline passed while it was queued")
        keep = self.running_ids | {rid for cls in QUEUE_CLASSES for _, rid in self.waiting[cls]}
        self.tenant_of = {r: t for r, t in self.tenant_of.items() if r in keep}

    def _expire(self, rid: str, cls: str, why: str) -> None:
        rec = self.store.get(rid)
        if rec is None or rec.status != "queued":
            return
        prompt_tokens = len(rec.request.prompt_ids)
        final = ended_final("FINISH_REASON_DEADLINE", prompt_tokens, why, rec.generated)
        if self.store.end_queued(rid, final, "expired"):
            metrics.EXPIRED.labels(cls).inc()
            log.info("expired", extra={"request_id": rid, "class": cls, "reason": why})

    def _fail(self, rec, cls: str, loads: list[VerifierLoad]) -> None:
        """Ends a request no live verifier's KV budget can ever hold."""
        largest = max(loads, key=lambda v: v.kv_budget)
        why = kv_fit_problem(
            len(rec.request.prompt_ids),
            rec.request.max_tokens,
            largest.kv_budget,
            largest.max_seq_len,
            largest.block_size,
        )
        self._end(rec, cls, why)

    def _end(self, rec, cls: str, why: str) -> None:
        """Ends a queued request that cannot run, with the reason."""
        prompt_tokens = len(rec.request.prompt_ids)
        final = ended_final("FINISH_REASON_ERROR", prompt_tokens, why, rec.generated)
        if self.store.end_queued(rec.request_id, final, "failed"):
            log.warning("failed", extra={"request_id": rec.request_id, "class": cls, "why": why})

    def _admit(self, target: VerifierLoad, rid: str, trace_ctx) -> bool | None:
        """True if admitted, False if the request no longer needs placing, None to retry."""
        address = target.address
        try:
            with telemetry.tracer.start_as_current_span(
                "scheduler.place", context=trace_ctx
            ) as span:
                span.set_attribute("verifier", address)
                resp = self.verifiers.get(address).Admit(
                    verifier_pb2.AdmitRequest(request_id=rid),
                    timeout=self.settings.timeout_seconds,
                    metadata=telemetry.inject(),
                )
                span.set_attribute("admitted", resp.admitted)
        except grpc.RpcError as e:
            log.warning("admit failed", extra={"verifier": address, "code": str(e.code())})
            return None
        if resp.admitted:
            log.info("placed", extra={"request_id": rid, "verifier": address})
            return True
        rec = self.store.get(rid)
        if rec is None or rec.status != "queued":
            return False
        # Refused: it had less room than its heartbeat showed. Until the next pass reads the
        # heartbeats again, it has only the slots it says are free, for every class: a slot
        # that frees meanwhile goes at the next pass to the class whose turn it is, not to
        # the class this pass tries next (a batch request refused on its turn would lose it).
        target.running = max(target.running, target.capacity - resp.free_slots)
        return None


def build(settings: SchedulerSettings):
    store = RequestStore.connect(settings)
    store.wait_reachable()
    store.ensure_queues()
    clients = VerifierClients()
    name = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
    server = Server(settings.host, settings.port, [name], callers=callers(name))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
        SchedulerService(settings, store, clients), server.grpc
    )
    consumer = settings.scheduler_id or socket.gethostname()
    placer = Placer(settings, store, clients, consumer=consumer)
    placer.recover()
    thread = threading.Thread(target=placer.run, name="placement", daemon=True)
    thread.start()
    server.start()
    server.watch({"redis reachable": store.ping})
    log.info("scheduler ready", extra={"port": server.port, "consumer": placer.consumer})

    def on_stop() -> None:
        placer.stop.set()
        thread.join(timeout=5)

    return server, on_stop
