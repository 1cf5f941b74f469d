"""Drafter gRPC service: one Speculate stream per verifier; deltas in, draft trees out."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..common import telemetry
from ..common.grpc_server import Server
from ..common.settings import DrafterSettings
from ..engine import models
from ..speculation import draft_model
from ..speculation.proposer import DraftCost, DraftJob, Proposer
from ..speculation.proposers import PROPOSERS
from ..speculation.tree import DraftTree, to_proto
from ..store import RequestStore, heartbeat_forever, now_ms
from ..v1 import drafter_pb2, drafter_pb2_grpc
from . import metrics
from .run_ahead import RunAhead

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """What a stream has told of one sequence."""

    tokens: list[int] = field(default_factory=list)  # the accepted history
    tenant: str = ""
    prompt_len: int = 0
    grammar: str = ""


class DrafterService(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, proposer: Proposer, run_ahead: bool = False, cost: DraftCost | None = None):
        self.proposer = proposer
        self.run_ahead = run_ahead
        # The draft model's price as timed at start: with each stream's first answer, so that
        # a verifier prices drafts before it has timed any (policy.CostModel.draft_prior).
        self.cost = (
            drafter_pb2.DraftCost(
                level_seconds=cost.level_seconds,
                catch_up_seconds_per_token=cost.catch_up_seconds_per_token,
            )
            if cost is not None
            else None
        )
        self._lock = threading.Lock()  # one proposal at a time: the cores are shared anyway
        # Drafting runs on one thread whichever gRPC thread serves the stream: OpenMP keeps a
        # team of workers for every thread that ran a parallel op, and a second team (a
        # verifier's stream that came back on another thread) would make more OpenMP threads
        # than cores (service.in_own_thread says what that costs).
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="draft-model")

    def _on_model_thread(self, fn, *args):
        return self._model_thread.submit(fn, *args).result()

    def Speculate(self, request_iterator, context):
        held: dict[str, _Held] = {}  # sequence id -> what this stream told of it
        ahead = RunAhead() if self.run_ahead else None
        cost = self.cost
        try:
            for request in request_iterator:
                response, drafted = self.answer(request, held, ahead)
                if cost is not None:
                    response.cost.CopyFrom(cost)
                    cost = None
                yield response
                if ahead is not None:  # while the verifier verifies what was just sent
                    with self._lock:
                        self._on_model_thread(ahead.draft, self.proposer, drafted)
        finally:
            with self._lock:
                for seq_id in held:
                    self.proposer.forget(seq_id)

    def _finished(self, seq: _Held | None, delta: drafter_pb2.SequenceDelta) -> None:
        """The sequence ended or moved away. One that completed (its last tokens come with
        the message) leaves its output to the proposer, for its tenant's later drafts."""
        with self._lock:
            if delta.completed and seq is not None and delta.accepted_len <= len(seq.tokens):
                del seq.tokens[delta.accepted_len :]
                seq.tokens.extend(delta.new_token_ids)
                self.proposer.learn(seq.tenant, seq.tokens, seq.prompt_len)
                metrics.LEARNED_TOKENS.set(self.proposer.learned_tokens())
            self.proposer.forget(delta.sequence_id)

    def answer(
        self, request: drafter_pb2.SpeculateRequest, held, ahead: RunAhead | None = None
    ) -> tuple[drafter_pb2.SpeculateResponse, list[tuple[DraftJob, DraftTree]]]:
        """The step's trees, and each job with the tree it got (for drafting ahead)."""
        response = drafter_pb2.SpeculateResponse(step=request.step)
        jobs, ready = [], {}
        for delta in request.sequences:
            sid = delta.sequence_id
            if delta.finished:
                self._finished(held.pop(sid, None), delta)
                if ahead is not None:
                    ahead.forget(sid)
                continue
            seq = held.get(sid)
            if delta.accepted_len == 0:  # a sequence's first message says whose it is
                seq = held[sid] = _Held(
                    tenant=delta.tenant, prompt_len=delta.prompt_len, grammar=delta.grammar
                )
            if seq is None or delta.accepted_len > len(seq.tokens):  # state lost (restart)
                held.pop(sid, None)
                with self._lock:
                    self.proposer.forget(sid)
                response.resync_ids.append(sid)  # the verifier resends all of it
                metrics.RESYNCS.inc()
                continue
            del seq.tokens[delta.accepted_len :]
            seq.tokens.extend(delta.new_token_ids)
            if delta.budget > 0 or delta.deep_budget > 0:
                job = DraftJob(
                    sid,
                    seq.tokens,
                    delta.budget,
                    delta.temperature,
                    delta.draw_seed,
                    # unset (a verifier that predates it): model-free trees get `budget`
                    deep_budget=delta.deep_budget if delta.HasField("deep_budget") else None,
                    tenant=seq.tenant,
                    grammar=seq.grammar,
                    prompt_len=seq.prompt_len,
                )
                tree = ahead.take(job, delta.accepted_len) if ahead is not None else None
                if tree is not None:
                    ready[sid] = tree
                jobs.append(job)
        to_draft = [job for job in jobs if job.seq_id not in ready]
        if to_draft:
            parent = telemetry.from_traceparent(request.traceparent)
            with (
                telemetry.tracer.start_as_current_span("drafter.propose", context=parent) as span,
                self._lock,
            ):
                started = time.perf_counter()
                trees = self._on_model_thread(self.proposer.propose, to_draft)
                seconds = time.perf_counter() - started
                span.set_attribute("sequences", len(to_draft))
                span.set_attribute("nodes", sum(map(len, trees)))
            metrics.PROPOSE_SECONDS.observe(seconds)
            if log.isEnabledFor(logging.DEBUG):  # (the verifier's "drafted" line: the round trip)
                log.debug(
                    "proposed",
                    extra={
                        "sequences": len(to_draft),
                        "nodes": [len(t) for t in trees],
                        "model_free": [t.model_free for t in trees],
                        "propose_ms": round(1000 * seconds, 1),
                    },
                )
            ready |= {job.seq_id: tree for job, tree in zip(to_draft, trees, strict=True)}
        drafted = []
        for job in jobs:
            tree = ready[job.seq_id]
            metrics.TREE_NODES.observe(len(tree))
            to_proto(tree, response.trees.add(sequence_id=job.seq_id))
            drafted.append((job, tree))
        return response, drafted


def build(settings: DrafterSettings):
    models.set_host_threads(settings.torch_threads, settings.device, "drafter.torch_threads")
    if settings.proposer in ("draft_model", "hybrid"):  # (a model-free one loads nothing)
        with models.cpu_start(settings.model_cache_dir, settings.device, "drafter"):
            settings = draft_model.with_dtype(settings)
            proposer = PROPOSERS[settings.proposer].from_settings(settings)
            # (timed alone on the cores, as a verifier's profile is: timed beside a verifier's
            # start, a level read 26 ms here against 16 ms once both ran)
            cost = proposer.timed_cost()
    else:
        proposer = PROPOSERS[settings.proposer].from_settings(settings)
        cost = None
    if cost is not None:
        log.info(
            "draft model timed",
            extra={
                "level_ms": round(1000 * cost.level_seconds, 2),
                "catch_up_ms_per_token": round(1000 * cost.catch_up_seconds_per_token, 2),
            },
        )
    store = RequestStore.connect(settings)
    store.wait_reachable()
    name = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name
    # Under mTLS, only verifiers draft.
    server = Server(
        settings.host, settings.port, [name], callers={f"/{name}/": frozenset({"verifier"})}
    )
    service = DrafterService(proposer, settings.run_ahead, cost)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(service, server.grpc)
    server.start()
    # Registered, verifiers find this drafter without a restart; gone, they move its sequences.
    # `started_ms` tells them a drafter came back (a new process at the same address).
    address = settings.advertise_address or f"{settings.host}:{server.port}"
    entry = {
        "address": address,
        "proposer": settings.proposer,
        "pool": settings.pool,
        "dtype": settings.dtype,  # what the draft model was loaded in
        "started_ms": now_ms(),
    }
    stop = threading.Event()
    heartbeat = threading.Thread(
        target=heartbeat_forever,
        args=(store, "drafter", address, lambda: entry),
        kwargs={"period": settings.heartbeat_seconds, "stop": stop},
        name="heartbeat",
        daemon=True,
    )
    heartbeat.start()
    server.watch({"redis reachable": store.ping})
    log.info(
        "drafter ready",
        extra={"address": address, "proposer": settings.proposer, "pool": settings.pool},
    )

    def on_stop() -> None:
        stop.set()
        heartbeat.join(timeout=5)

    return server, on_stop
