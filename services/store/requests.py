"""A request's life in Redis: every change of its status, and what it records.

Owns a request's hash (req:<id>) and its output stream (out:<id>) as they move through the
state machine; the queues they wait in are read in queues.py, the output is read in
outputs.py (see schema.KEYS).

Status moves queued -> running -> finished | cancelled | failed | expired, or queued ->
cancelled | expired (waited past its class timeout or its deadline):

    create        (scheduler)  -> queued
    claim         (verifier)   queued -> running
    commit_step   (verifier)   running: appends generated tokens
    finish        (verifier)   running -> finished | cancelled | failed
    requeue       (scheduler, verifier)  running -> queued, its progress kept
    cancel        (scheduler)  queued -> cancelled; running: flagged, its verifier ends it
    end_queued    (scheduler)  queued -> expired | failed

A running request whose verifier died or drained goes back to queued (requeue) with its
progress kept in out:<id>; its next verifier prefills prompt + the tokens generated so far
and goes on from there. A request that has generated tokens is claimed only by a verifier of
the model version that generated them: no stream mixes versions.
Every write of a running request is fenced by owner and incarnation: a verifier that lost a
request (it was requeued while that verifier was thought dead), or an earlier incarnation of a
verifier that restarted under the same id, can no longer write to it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import Any

from google.protobuf import json_format

from ..common.outage import REDIS_ERRORS
from ..v1 import scheduler_pb2
from . import scripts
from .connection import Connection
from .schema import GROUP, now_ms

log = logging.getLogger(__name__)


class StepState(IntEnum):
    """What a step's write says about a running request (`RequestStore.commit_step`)."""

    LOST = -1  # the verifier no longer owns it (requeued elsewhere): drop it
    OK = 0
    CANCELLED = 1
    PAUSED = 2  # more unread tokens than the verifier allows: generate nothing for now


@dataclass
class RequestRecord:
    """What Redis holds about one request (decoded). Its `spec` is the `SubmitRequest` in the
    proto's JSON mapping (proto field names; readable with redis-cli, and a field one version
    adds is skipped by a version that does not know it); `request` is that message, typed."""

    request_id: str
    spec: dict[str, Any]  # SubmitRequest as a JSON dict (proto field names)
    status: str
    queue: str
    entry_id: str
    owner: str
    generated: int
    created_ms: int
    admitted_ms: int
    cancel: bool
    requeues: int = 0
    version: str = ""  # model version of the verifier that claimed it last
    pool: str = ""
    incarnation: str = ""  # of the owner, when running

    @cached_property
    def request(self) -> scheduler_pb2.SubmitRequest:
        """The request as it was submitted, typed: what every service reads it as. (The
        prompt's ids are added apart: json_format parses a field's values one by one in
        Python, 15 ms for a 16k-token prompt, against a fraction of a millisecond here.)"""
        rest = {k: v for k, v in self.spec.items() if k != "prompt_ids"}
        request = json_format.ParseDict(
            rest, scheduler_pb2.SubmitRequest(), ignore_unknown_fields=True
        )
        request.prompt_ids.extend(int(t) for t in self.spec.get("prompt_ids", ()))
        return request


@dataclass(frozen=True)
class Claim:
    """A running request as Redis records who runs it."""

    request_id: str
    verifier_id: str
    incarnation: str
    admitted_ms: int  # on the verifier's clock


class RequestLifecycle(Connection):
    """Create, claim, commit steps, finish, requeue, cancel; read a request back."""

    # From results.py (a RequestStore has both): how long an ended request is kept, and the
    # session hint a finished turn leaves.
    result_ttl: Callable[[], int]
    set_session_owner: Callable[[str, str], None]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        register = self.r.register_script
        self._create = register(scripts.CREATE)
        self._claim = register(scripts.CLAIM)
        self._commit = register(scripts.COMMIT)
        self._finish = register(scripts.FINISH)
        self._requeue = register(scripts.REQUEUE)
        self._end_queued = register(scripts.END_QUEUED)

    # --- the scheduler's side -------------------------------------------------------------
    def create(
        self,
        rid: str,
        spec: scheduler_pb2.SubmitRequest | dict[str, Any] | str,
        cls: str,
        limit: int,
        fingerprint: str = "",
    ) -> tuple[int, int]:
        """Persists and queues a request (a `SubmitRequest`, kept in the proto's JSON
        mapping: `spec_json`). Returns (code, waiting): 0 created, 1 existed (with the same
        `fingerprint`, what the request asks, or one not known: ""), 2 full, 3 the id is
        taken by a request with another fingerprint. On Redis Cluster the limit holds per
        shard: `limit` / CLUSTER_SHARDS (rounded up)."""
        at = self.layout
        shard = at.shard_of(rid)
        if at.shards > 1:
            limit = -(-limit // at.shards)
        code, waiting = self._durable(
            self._create,
            [at.req(rid), at.queue(cls, shard), at.queued(cls, shard)],
            [spec_json(spec), GROUP, limit, cls, now_ms(), rid, fingerprint],
        )
        return int(code), int(waiting)

    def cancel(self, rid: str, final: dict[str, Any]) -> tuple[int, str]:
        """Ends a queued request, flags a running one. Returns (state, owner) as END_QUEUED."""
        return self._end(rid, final, "cancelled", flag_running=True)

    def end_queued(self, rid: str, final: dict[str, Any], status: str) -> bool:
        """Ends a request that is still queued (expired, failed); False if it was not."""
        return self._end(rid, final, status, flag_running=False)[0] == 1

    def _end(self, rid: str, final: dict, status: str, flag_running: bool) -> tuple[int, str]:
        at = self.layout
        shard = at.shard_of(rid)
        state, owner = self._end_queued(
            keys=[
                at.req(rid),
                at.out(rid),
                *at.per_class(at.queue, shard),
                *at.per_class(at.queued, shard),
            ],
            args=[json.dumps(final), GROUP, self.result_ttl(), status, int(flag_running)],
        )
        return int(state), owner or ""

    # --- the verifier's side --------------------------------------------------------------
    def claim(
        self,
        rid: str,
        vid: str,
        at_ms: int,
        version: str = "",
        pool: str = "",
        incarnation: str = "",
    ) -> int:
        """Moves a queued request to running on verifier `vid` in its `incarnation` (serving
        model `version` in `pool`), admitted at `at_ms`. Returns 1 if claimed, 0 if it is not
        queued, 2 if it generated tokens on another model version (it must finish there)."""
        at = self.layout
        shard = at.shard_of(rid)
        keys = [at.req(rid), at.owned(vid, shard), at.owners(shard)]
        return int(
            self._claim(
                keys=[*keys, *at.per_class(at.queued, shard)],
                args=[vid, at_ms, rid, version, pool, incarnation],
            )
        )

    def commit_step(
        self,
        vid: str,
        steps: list[tuple[str, int, list[int]] | tuple[str, int, list[int], list[str]]],
        version: str = "",
        incarnation: str = "",
        max_unread: int = 0,
    ) -> list[tuple[StepState, int] | None]:
        """One round trip per step: for each running (rid, first_index, new ids[, their
        log-probabilities, encoded]) of verifier `vid` in its `incarnation` (serving model
        `version`), appends the ids to its output stream (see scripts.COMMIT).
        Returns per request (state, generated): CANCELLED, LOST if `vid` no longer owns it
        (requeued elsewhere), PAUSED if it has generated more than `max_unread` (> 0) tokens
        past what its client was sent, else OK; None where the write failed (write it
        again)."""
        calls = []
        for rid, first, ids, *logprobs in steps:
            args = [vid, first, ",".join(map(str, ids)), len(ids), version, incarnation]
            lps = ";".join(logprobs[0]) if logprobs and logprobs[0] is not None else ""
            calls.append(([self.layout.req(rid), self.layout.out(rid)], [*args, max_unread, lps]))
        results = self._pipelined(self._commit, calls)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:  # e.g. NOSCRIPT from a restarted Redis: the rest went through
            log.warning(
                "step writes failed", extra={"failed": len(failed), "error": str(failed[0])}
            )
        return [
            None if isinstance(r, Exception) else (StepState(int(r[0])), int(r[1])) for r in results
        ]

    def finish(
        self,
        rid: str,
        vid: str,
        status: str,
        final: dict[str, Any],
        queue: str,
        session_id: str = "",
        incarnation: str = "",
    ) -> bool:
        """Ends a request running on `vid` in its `incarnation`: final stream entry, status,
        queue entry acked and deleted; with `session_id`, the session's next turn is to go to
        `vid`. False if `vid` (in that incarnation) no longer owns the request."""
        at = self.layout
        shard = at.shard_of(rid)
        done = self._durable(
            self._finish,
            [at.req(rid), at.out(rid), at.queue(queue, shard), at.owned(vid, shard)],
            [
                vid,
                status,
                json.dumps(final),
                final["usage"]["completion_tokens"],
                GROUP,
                rid,
                self.result_ttl(),
                incarnation,
            ],
        )
        if done and session_id:  # a hint for the session's next turn (another slot: not in
            try:  # the script; a hint lost costs a cache miss, never the request's end)
                self.set_session_owner(session_id, vid)
            except REDIS_ERRORS:
                log.warning("session hint not written", extra={"request_id": rid})
        return bool(done)

    def requeue(
        self, rid: str, vid: str, incarnation: str | None = None, admitted_ms: int | None = None
    ) -> bool:
        """Hands a request running on `vid` back to its queue with its progress; False if
        it was not running there. With `incarnation` (and `admitted_ms`), only that claim
        of it: not one made since."""
        fence = ["*" if incarnation is None else incarnation]
        fence.append("*" if admitted_ms is None else str(admitted_ms))
        at = self.layout
        shard = at.shard_of(rid)
        keys = [at.req(rid), at.owned(vid, shard)]
        for key in (at.queue, at.queued, at.requeued):
            keys += at.per_class(key, shard)
        return bool(self._requeue(keys=keys, args=[vid, GROUP, rid, *fence]))

    # --- reading a request back -----------------------------------------------------------
    def exists(self, rid: str) -> bool:
        return bool(self.r.exists(self.layout.req(rid)))

    def get(self, rid: str) -> RequestRecord | None:
        h = self.r.hgetall(self.layout.req(rid))
        if not h:
            return None
        return RequestRecord(
            request_id=rid,
            spec=json.loads(h["spec"]),
            status=h.get("status", ""),
            queue=h.get("queue", ""),
            entry_id=h.get("entry_id", ""),
            owner=h.get("owner", ""),
            generated=int(h.get("generated", 0)),
            created_ms=int(h.get("created_ms", 0)),
            admitted_ms=int(h.get("admitted_ms", 0) or 0),
            cancel=h.get("cancel") == "1",
            requeues=int(h.get("requeues", 0)),
            version=h.get("version", ""),
            pool=h.get("pool", ""),
            incarnation=h.get("incarnation", ""),
        )

    def progress(self, rid: str) -> list[int]:
        """The tokens generated so far, from the output stream (placed by index, so a
        repeated entry counts once)."""
        ids: list[int] = []
        for _, fields in self.r.xrange(self.layout.out(rid)):
            chunk = [int(t) for t in fields["ids"].split(",")] if fields.get("ids") else []
            if int(fields["first"]) == len(ids):
                ids.extend(chunk)
        return ids

    def tenants(self, rids: list[str]) -> dict[str, str]:
        """The tenant of each request (empty: it has none, or it is gone); one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.hget(self.layout.req(rid), "spec")
        specs = pipe.execute() if rids else []
        return {
            rid: json.loads(spec).get("tenant", "") if spec else ""
            for rid, spec in zip(rids, specs, strict=True)
        }


def spec_json(spec: scheduler_pb2.SubmitRequest | dict[str, Any] | str) -> str:
    """A request as its record stores it: the proto's JSON mapping, proto field names (a
    string is taken as that already)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, scheduler_pb2.SubmitRequest):
        spec = json_format.MessageToDict(spec, preserving_proto_field_name=True)
    return json.dumps(spec)
