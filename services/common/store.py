"""The Redis schema and every state transition of a request; the only module that writes it.

Keys (prefix `specserve:`):
  req:{id}        hash   spec (JSON), status, queue, entry_id, owner, cancel, generated,
                         created_ms, admitted_ms, final (JSON)
  out:{id}        stream one entry per step: first (absolute index), ids (comma list);
                         the last entry has final (JSON)
  queue:{class}   stream one entry per queued request (field rid); consumer group `placement`;
                         acked and deleted when the request ends
  queued:{class}  int    requests of the class with status queued (the queue length limit)
  verifier:{id}   hash   address, model, capacity, running, batch_capacity, batch_running,
                         kv_budget, kv_reserved, kv_cached, max_seq_len (expires without heartbeats)
  verifiers       set    registered verifier ids
  drafter:{id}    hash   address (expires without heartbeats)
  drafters        set    registered drafter ids
  result:{hash}   hash   ids, final (JSON) of a finished deterministic request (result cache, TTL)
  session:{sid}   string id of the verifier whose prefix cache holds the session's last turn

Status moves queued -> running -> finished | cancelled | failed, or queued -> cancelled |
expired (waited past its class timeout or its deadline).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger(__name__)

PREFIX = "specserve:"
GROUP = "placement"
QUEUE_CLASSES = ("interactive", "batch")
ENDED = ("finished", "cancelled", "failed", "expired")
RESULT_TTL_SECONDS = 3600


def req_key(rid: str) -> str:
    return f"{PREFIX}req:{rid}"


def out_key(rid: str) -> str:
    return f"{PREFIX}out:{rid}"


def queue_key(cls: str) -> str:
    return f"{PREFIX}queue:{cls}"


def queued_key(cls: str) -> str:
    return f"{PREFIX}queued:{cls}"


def member_key(kind: str, member_id: str) -> str:
    return f"{PREFIX}{kind}:{member_id}"


def members_key(kind: str) -> str:
    return f"{PREFIX}{kind}s"


def result_key(key: str) -> str:
    return f"{PREFIX}result:{key}"


def session_key(sid: str) -> str:
    return f"{PREFIX}session:{sid}"


def now_ms() -> int:
    return int(time.time() * 1000)


# Creates the request and queues it, unless it exists (idempotency) or the queue is full.
# Returns {code, waiting}: code 0 created, 1 existed, 2 queue full.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {1, 0} end
local waiting = tonumber(redis.call('GET', KEYS[3]) or '0')
if waiting >= tonumber(ARGV[3]) then return {2, waiting} end
local id = redis.call('XADD', KEYS[2], '*', 'rid', ARGV[6])
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'status', 'queued', 'queue', ARGV[4],
           'entry_id', id, 'created_ms', ARGV[5], 'generated', 0)
redis.call('INCR', KEYS[3])
return {0, waiting}
"""

# Moves a queued request to running on a verifier. Returns 1 if claimed, 0 if not queued.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'admitted_ms', ARGV[2])
local counter = ARGV[3] .. redis.call('HGET', KEYS[1], 'queue')
if tonumber(redis.call('GET', counter) or '0') > 0 then redis.call('DECR', counter) end
return 1
"""

# Ends a queued request now with status ARGV[5] (cancelled, expired); with ARGV[6] == '1' a
# running one gets the cancel flag its verifier reads.
# Returns {state, owner}: state 0 already ended/unknown, 1 was queued (ended now), 2 running.
_END_QUEUED = """
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'status', ARGV[5], 'final', ARGV[1])
  redis.call('XADD', KEYS[2], '*', 'first', 0, 'ids', '', 'final', ARGV[1])
  local q = redis.call('HGET', KEYS[1], 'queue')
  local e = redis.call('HGET', KEYS[1], 'entry_id')
  redis.call('XACK', ARGV[2] .. q, ARGV[3], e)
  redis.call('XDEL', ARGV[2] .. q, e)
  if tonumber(redis.call('GET', ARGV[7] .. q) or '0') > 0 then redis.call('DECR', ARGV[7] .. q) end
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return {1, ''}
elseif st == 'running' and ARGV[6] == '1' then
  redis.call('HSET', KEYS[1], 'cancel', 1)
  return {2, redis.call('HGET', KEYS[1], 'owner')}
end
return {0, ''}
"""


@dataclass
class RequestRecord:
    """What Redis holds about one request (decoded)."""

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


class RequestStore:
    """Request lifecycle in Redis: create, claim, progress, cancel, finish, tail."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)
        self._end_queued = client.register_script(_END_QUEUED)

    @classmethod
    def from_url(cls, url: str) -> RequestStore:
        return cls(redis.Redis.from_url(url, decode_responses=True, health_check_interval=10))

    def ensure_queues(self) -> None:
        """Creates the queues and their consumer group, and the queued counters if missing
        (from the entries not yet delivered: a store written before the counters existed)."""
        for cls in QUEUE_CLASSES:
            try:
                self.r.xgroup_create(queue_key(cls), GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            if not self.r.exists(queued_key(cls)):
                pending = int(self.r.xpending(queue_key(cls), GROUP)["pending"])
                self.r.set(queued_key(cls), self.r.xlen(queue_key(cls)) - pending, nx=True)

    # --- scheduler side -------------------------------------------------------------------
    def create(self, rid: str, spec: dict[str, Any], cls: str, limit: int) -> tuple[int, int]:
        """Persists and queues a request. Returns (code, waiting): 0 created, 1 existed, 2 full."""
        code, waiting = self._create(
            keys=[req_key(rid), queue_key(cls), queued_key(cls)],
            args=[json.dumps(spec), GROUP, limit, cls, now_ms(), rid],
        )
        return int(code), int(waiting)

    def read_queue(self, cls: str, consumer: str, count: int) -> list[tuple[str, str]]:
        """New (undelivered) queue entries of a class as (entry_id, request_id)."""
        resp = self.r.xreadgroup(GROUP, consumer, {queue_key(cls): ">"}, count=count)
        return [(eid, fields["rid"]) for _, entries in resp for eid, fields in entries]

    def pending_entries(self, cls: str, consumer: str, count: int = 100) -> list[tuple[str, str]]:
        """Entries delivered to this consumer but not yet acked (placed or waiting)."""
        resp = self.r.xreadgroup(GROUP, consumer, {queue_key(cls): "0"}, count=count)
        return [(eid, fields["rid"]) for _, entries in resp for eid, fields in entries if fields]

    def cancel(self, rid: str, final: dict[str, Any]) -> tuple[int, str]:
        """Ends a queued request, flags a running one. Returns (state, owner) as _END_QUEUED."""
        return self._end(rid, final, "cancelled", flag_running=True)

    def end_queued(self, rid: str, final: dict[str, Any], status: str) -> bool:
        """Ends a request that is still queued (expired, failed); False if it was not."""
        return self._end(rid, final, status, flag_running=False)[0] == 1

    def _end(self, rid: str, final: dict, status: str, flag_running: bool) -> tuple[int, str]:
        state, owner = self._end_queued(
            keys=[req_key(rid), out_key(rid)],
            args=[
                json.dumps(final),
                f"{PREFIX}queue:",
                GROUP,
                RESULT_TTL_SECONDS,
                status,
                int(flag_running),
                f"{PREFIX}queued:",
            ],
        )
        return int(state), owner or ""

    def queued_before(self, cls: str, cutoff_ms: int, count: int) -> list[str]:
        """Request ids of the class's queue entries created before cutoff_ms (oldest first;
        entries of running requests are among them until they end)."""
        entries = self.r.xrange(queue_key(cls), "-", cutoff_ms, count=count)
        return [fields["rid"] for _, fields in entries if "rid" in fields]

    def waiting_count(self, cls: str) -> int:
        """Requests of the class queued and not yet running."""
        return int(self.r.get(queued_key(cls)) or 0)

    def live_verifiers(self) -> list[dict[str, str]]:
        """Registered verifiers whose heartbeat has not expired."""
        return self.live("verifier")

    def live(self, kind: str) -> list[dict[str, str]]:
        """Registered members of a kind (verifier, drafter) whose heartbeat has not expired."""
        ids = sorted(self.r.smembers(members_key(kind)))
        pipe = self.r.pipeline(transaction=False)
        for member in ids:
            pipe.hgetall(member_key(kind, member))
        out = []
        for member, info in zip(ids, pipe.execute(), strict=True):
            if info:
                out.append({"id": member, **info})
            else:
                self.r.srem(members_key(kind), member)
        return out

    def session_owner(self, sid: str) -> str | None:
        """The verifier holding the session's cached prefix, if any."""
        return self.r.get(session_key(sid)) if sid else None

    # --- verifier side --------------------------------------------------------------------
    def heartbeat(
        self, member_id: str, info: dict[str, Any], ttl_seconds: float, kind: str = "verifier"
    ) -> None:
        """Registers a member of a kind with its info; it expires without the next beat."""
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(members_key(kind), member_id)
        pipe.hset(member_key(kind, member_id), mapping=info)
        pipe.pexpire(member_key(kind, member_id), int(ttl_seconds * 1000))
        pipe.execute()

    def deregister(self, member_id: str, kind: str = "verifier") -> None:
        self.r.srem(members_key(kind), member_id)
        self.r.delete(member_key(kind, member_id))

    def claim(self, rid: str, vid: str, at_ms: int) -> bool:
        """Moves a queued request to running on verifier `vid`, admitted at `at_ms`."""
        return bool(self._claim(keys=[req_key(rid)], args=[vid, at_ms, f"{PREFIX}queued:"]))

    def get(self, rid: str) -> RequestRecord | None:
        h = self.r.hgetall(req_key(rid))
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
        )

    def commit_step(
        self, progress: list[tuple[str, int, list[int]]], watch: list[str]
    ) -> list[bool]:
        """One round trip per step: append each (rid, first_index, ids) to its output stream,
        record the generated count, and read the cancel flags of `watch`."""
        pipe = self.r.pipeline(transaction=False)
        for rid, first, ids in progress:
            pipe.xadd(out_key(rid), {"first": first, "ids": ",".join(map(str, ids))})
            pipe.hset(req_key(rid), "generated", first + len(ids))
        for rid in watch:
            pipe.hget(req_key(rid), "cancel")
        results = pipe.execute()
        return [v == "1" for v in results[2 * len(progress) :]]

    def finish(
        self,
        rid: str,
        status: str,
        final: dict[str, Any],
        queue: str,
        entry: str,
        session: tuple[str, str] | None = None,
    ) -> None:
        """Ends a request: final stream entry, status, queue entry acked and deleted; with
        `session` (session id, verifier id), the session's next turn is to go there."""
        pipe = self.r.pipeline(transaction=True)
        if session is not None:
            pipe.set(session_key(session[0]), session[1], ex=RESULT_TTL_SECONDS)
        pipe.xadd(
            out_key(rid),
            {"first": final["usage"]["completion_tokens"], "ids": "", "final": json.dumps(final)},
        )
        pipe.hset(req_key(rid), mapping={"status": status, "final": json.dumps(final)})
        pipe.xack(queue_key(queue), GROUP, entry)
        pipe.xdel(queue_key(queue), entry)
        pipe.expire(req_key(rid), RESULT_TTL_SECONDS)
        pipe.expire(out_key(rid), RESULT_TTL_SECONDS)
        pipe.execute()

    # --- gateway side ---------------------------------------------------------------------
    def tail(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Output-stream entries after last_id, waiting up to block_ms for the first."""
        resp = self.r.xread({out_key(rid): last_id}, block=block_ms, count=64)
        return [entry for _, entries in resp for entry in entries]

    def largest_verifier(self) -> tuple[int, int] | None:
        """(kv_budget, max_seq_len) of the live verifier with the largest KV budget."""
        rows = [v for v in self.live_verifiers() if "kv_budget" in v]
        if not rows:
            return None
        best = max(rows, key=lambda v: int(v["kv_budget"]))
        return int(best["kv_budget"]), int(best.get("max_seq_len", 0))

    def cached_result(self, key: str) -> tuple[list[int], dict[str, Any]] | None:
        """A result cache entry: (token ids, FinalInfo JSON), or None."""
        h = self.r.hgetall(result_key(key))
        if not h:
            return None
        return [int(t) for t in h["ids"].split(",") if t], json.loads(h["final"])

    def cache_result(self, key: str, ids: list[int], final: dict, ttl_seconds: float) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            result_key(key), mapping={"ids": ",".join(map(str, ids)), "final": json.dumps(final)}
        )
        pipe.pexpire(result_key(key), int(ttl_seconds * 1000))
        pipe.execute()


def heartbeat_forever(
    store: RequestStore,
    kind: str,
    member_id: str,
    info: Callable[[], dict[str, Any]],
    period: float,
    stop: threading.Event,
) -> None:
    """Keeps a member registered (ttl: three periods) until `stop` is set; then removes it."""
    while not stop.is_set():
        try:
            store.heartbeat(member_id, info(), ttl_seconds=3 * period, kind=kind)
        except Exception:
            log.exception("heartbeat failed", extra={"kind": kind})
        stop.wait(period)
    try:
        store.deregister(member_id, kind)
    except redis.RedisError:
        log.warning("deregistration failed; the entry expires", extra={"kind": kind})
