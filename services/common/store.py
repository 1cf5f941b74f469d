"""The Redis schema and every state transition of a request; the only module that writes it.

Keys (prefix `specserve:`):
  req:{id}        hash   spec (JSON), status, queue, entry_id, owner, incarnation (of the
                         owner), cancel, generated, created_ms, admitted_ms, requeues,
                         final (JSON), version and pool (of the verifier that claimed it last),
                         read (tokens the gateway has sent its client; absent: nobody
                         streams it through a gateway)
  out:{id}        stream one entry per step: first (absolute index), ids (comma list),
                         v (the model version that produced them); the last entry has
                         final (JSON). Only the owner appends, and only at index
                         `generated`: a retried or stale write is dropped
  queue:{class}   stream one entry per queued request (field rid); consumer group `placement`;
                         acked and deleted when the request ends or is requeued
  owned:{vid}     set    ids of the requests running on verifier vid
  owners          set    verifier ids that may own running requests (the reaper's list)
  requeued:{class} list  "entry_id rid" of requests put back in the queue, for the scheduler
                         to place ahead of their class
  queued:{class}  int    requests of the class with status queued (the queue length limit)
  verifier:{id}   hash   address, incarnation, model, version, pool, config, capacity,
                         running, batch_capacity, batch_running, kv_budget (tokens),
                         block_size, kv_blocks, kv_used, kv_cached, kv_free (blocks),
                         prefixes (comma list of short hashes of its cached blocks),
                         max_seq_len, request_ids (comma list of the requests it runs) and
                         listed_ms (when it listed them) (expires without heartbeats)
  verifiers       set    registered verifier ids
  drafter:{id}    hash   address, proposer, pool (expires without heartbeats)
  drafters        set    registered drafter ids
  result:{hash}   hash   ids, final (JSON) of a finished deterministic request (result cache, TTL)
  session:{sid}   string id of the verifier the session's last turn finished on (a hint)
  rollout         hash   canary_share (of new requests placed on the canary pool),
                         previous_share, updated_ms

Status moves queued -> running -> finished | cancelled | failed | expired, or queued ->
cancelled | expired (waited past its class timeout or its deadline). A running request whose
verifier died or drained goes back to queued (requeue) with its progress kept in out:{id};
its next verifier prefills prompt + the tokens generated so far and goes on from there.
A request that has generated tokens is claimed only by a verifier of the model version that
generated them: no stream mixes versions.
Every write of a running request is fenced by owner and incarnation: a verifier that lost a
request (it was requeued while that verifier was thought dead), or an earlier incarnation of a
verifier that restarted under the same id, can no longer write to it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .outage import REDIS_UNREACHABLE, OutageLog

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


def owned_key(vid: str) -> str:
    return f"{PREFIX}owned:{vid}"


OWNERS_KEY = f"{PREFIX}owners"
ROLLOUT_KEY = f"{PREFIX}rollout"
REQUEUED = f"{PREFIX}requeued:"


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

# Moves a queued request to running on verifier ARGV[1], incarnation ARGV[7] (model version
# ARGV[5], pool ARGV[6]). Returns 1 if claimed, 0 if not queued, 2 if it generated tokens on
# another version.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
local version = redis.call('HGET', KEYS[1], 'version')
if version and version ~= ARGV[5]
   and tonumber(redis.call('HGET', KEYS[1], 'generated')) > 0 then return 2 end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'admitted_ms', ARGV[2],
           'version', ARGV[5], 'pool', ARGV[6], 'incarnation', ARGV[7])
local counter = ARGV[3] .. redis.call('HGET', KEYS[1], 'queue')
if tonumber(redis.call('GET', counter) or '0') > 0 then redis.call('DECR', counter) end
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# One step of a running request, by its owner ARGV[1] in incarnation ARGV[6] (model version
# ARGV[5]): ids ARGV[3]
# (comma list, ARGV[4] of them) from index ARGV[2]. Only the part past `generated` is
# appended: a retried write that went through before appends nothing, one that went through
# in part appends the rest.
# Returns {-1, 0} if the caller no longer owns the request (it must drop it), else
# {state, generated} with state 1 if it was cancelled, 2 if it is more than ARGV[7] (> 0)
# tokens ahead of what its client was sent (`read`), 0 else (StepState); the caller goes on
# from `generated` (after a gap, which only a Redis that lost writes leaves, it resends
# from there).
_COMMIT = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1]
   or (redis.call('HGET', KEYS[1], 'incarnation') or '') ~= ARGV[6] then return {-1, 0} end
local generated = tonumber(redis.call('HGET', KEYS[1], 'generated'))
local first, n = tonumber(ARGV[2]), tonumber(ARGV[4])
if generated >= first and generated < first + n then
  local ids = {}
  for t in string.gmatch(ARGV[3], '[^,]+') do ids[#ids + 1] = t end
  redis.call('XADD', KEYS[2], '*', 'first', generated,
             'ids', table.concat(ids, ',', generated - first + 1), 'v', ARGV[5])
  generated = first + n
  redis.call('HSET', KEYS[1], 'generated', generated)
end
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return {1, generated} end
local limit = tonumber(ARGV[7])
local read = redis.call('HGET', KEYS[1], 'read')
if limit > 0 and read and generated - tonumber(read) > limit then return {2, generated} end
return {0, generated}
"""

# The gateway has sent the client of a request ARGV[1] tokens (unless the request is gone).
_READ = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'read', ARGV[1]) end
return 1
"""

# Ends a running request owned by ARGV[1] in incarnation ARGV[9] with status ARGV[2] and final
# ARGV[3]; KEYS[3] is its queue, KEYS[4] the owner's set, KEYS[5] the session key ('' value:
# none).
# Returns 1, or 0 if the caller does not own it (someone else finishes it).
_FINISH = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1]
   or (redis.call('HGET', KEYS[1], 'incarnation') or '') ~= ARGV[9] then return 0 end
redis.call('XADD', KEYS[2], '*', 'first', ARGV[4], 'ids', '', 'final', ARGV[3])
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'final', ARGV[3])
local e = redis.call('HGET', KEYS[1], 'entry_id')
redis.call('XACK', KEYS[3], ARGV[5], e)
redis.call('XDEL', KEYS[3], e)
redis.call('SREM', KEYS[4], ARGV[7])
if ARGV[6] ~= '' then redis.call('SET', KEYS[5], ARGV[6], 'EX', ARGV[8]) end
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('EXPIRE', KEYS[2], ARGV[8])
return 1
"""

# Puts a running request owned by ARGV[1] back in its queue (a new entry; the old one is acked
# and deleted; the new one also listed in requeued:{class}), keeping its progress. KEYS[2] is
# the owner's set. Only the claim of incarnation ARGV[7] admitted at ARGV[8] ('*': any) is
# requeued. Returns 1, or 0 if it is not running there (ended, already requeued, or claimed
# since by another incarnation or again).
_REQUEUE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  redis.call('SREM', KEYS[2], ARGV[5])
  return 0
end
if (ARGV[7] ~= '*' and (redis.call('HGET', KEYS[1], 'incarnation') or '') ~= ARGV[7])
   or (ARGV[8] ~= '*' and redis.call('HGET', KEYS[1], 'admitted_ms') ~= ARGV[8]) then
  return 0
end
local q = redis.call('HGET', KEYS[1], 'queue')
local e = redis.call('HGET', KEYS[1], 'entry_id')
redis.call('XACK', ARGV[2] .. q, ARGV[3], e)
redis.call('XDEL', ARGV[2] .. q, e)
local id = redis.call('XADD', ARGV[2] .. q, '*', 'rid', ARGV[5])
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '', 'entry_id', id)
redis.call('HINCRBY', KEYS[1], 'requeues', 1)
redis.call('INCR', ARGV[4] .. q)
redis.call('SREM', KEYS[2], ARGV[5])
redis.call('RPUSH', ARGV[6] .. q, id .. ' ' .. ARGV[5])
return 1
"""

# Ends a queued request now with status ARGV[5] (cancelled, expired); with ARGV[6] == '1' a
# running one gets the cancel flag its verifier reads.
# Returns {state, owner}: state 0 already ended/unknown, 1 was queued (ended now), 2 running.
_END_QUEUED = """
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'status', ARGV[5], 'final', ARGV[1])
  local generated = redis.call('HGET', KEYS[1], 'generated') or 0
  redis.call('XADD', KEYS[2], '*', 'first', generated, 'ids', '', 'final', ARGV[1])
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


class StepState(IntEnum):
    """What a step's write says about a running request (`RequestStore.commit_step`)."""

    LOST = -1  # the verifier no longer owns it (requeued elsewhere): drop it
    OK = 0
    CANCELLED = 1
    PAUSED = 2  # more unread tokens than the verifier allows: generate nothing for now


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
    requeues: int = 0
    version: str = ""  # model version of the verifier that claimed it last
    pool: str = ""
    incarnation: str = ""  # of the owner, when running


@dataclass(frozen=True)
class Claim:
    """A running request as Redis records who runs it."""

    request_id: str
    verifier_id: str
    incarnation: str
    admitted_ms: int  # on the verifier's clock


class RequestStore:
    """Request lifecycle in Redis: create, claim, progress, cancel, finish, tail."""

    def __init__(self, client: redis.Redis, probe: redis.Redis | None = None):
        self.r = client
        self._probe = probe or client  # health checks: one try, short timeouts
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)
        self._end_queued = client.register_script(_END_QUEUED)
        self._commit = client.register_script(_COMMIT)
        self._finish = client.register_script(_FINISH)
        self._requeue = client.register_script(_REQUEUE)
        self._read = client.register_script(_READ)

    @classmethod
    def from_url(cls, url: str) -> RequestStore:
        """A client that rides out a short Redis outage: a command that meets a dropped
        connection is retried with exponential backoff (about 6 s in all) before it fails.
        Every write here is safe to repeat (scripts check state; steps are written by index)."""
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=10)
        client = redis.Redis.from_url(
            url,
            decode_responses=True,
            health_check_interval=10,
            socket_connect_timeout=2,
            socket_timeout=10,
            retry=retry,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        probe = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        return cls(client, probe)

    def wait_reachable(self, period_cap: float = 5.0) -> None:
        """Blocks until Redis answers, logging each miss: a service that starts before
        Redis waits for it (not serving meanwhile) instead of failing."""
        delay = 0.2
        while not self.ping():
            log.warning("redis unreachable; waiting", extra={"retry_in_s": delay})
            time.sleep(delay)
            delay = min(period_cap, delay * 2)

    def ping(self) -> bool:
        """True if Redis answers now."""
        try:
            return bool(self._probe.ping())
        except redis.RedisError:
            return False

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

    def rollout(self) -> dict[str, float]:
        """The rollout: canary_share (0 to 1) and the share before the last change."""
        h = self.r.hgetall(ROLLOUT_KEY)
        return {
            "canary_share": float(h.get("canary_share", 0.0)),
            "previous_share": float(h.get("previous_share", 0.0)),
            "updated_ms": int(h.get("updated_ms", 0)),
        }

    def set_canary_share(self, share: float) -> float:
        """Sets the share of new requests placed on the canary pool; returns the old one."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"canary share must be within [0, 1], got {share}")
        old = self.rollout()["canary_share"]
        self.r.hset(
            ROLLOUT_KEY,
            mapping={"canary_share": share, "previous_share": old, "updated_ms": now_ms()},
        )
        return old

    def drafters(self, pool: str) -> list[str]:
        """Addresses of the live drafters of a rollout pool (a canary drafts for canaries)."""
        rows = self.live("drafter")
        return [d["address"] for d in rows if "address" in d and d.get("pool", "stable") == pool]

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
        return int(
            self._claim(
                keys=[req_key(rid), owned_key(vid), OWNERS_KEY],
                args=[vid, at_ms, f"{PREFIX}queued:", rid, version, pool, incarnation],
            )
        )

    def progress(self, rid: str) -> list[int]:
        """The tokens generated so far, from the output stream (placed by index, so a
        repeated entry counts once)."""
        ids: list[int] = []
        for _, fields in self.r.xrange(out_key(rid)):
            chunk = [int(t) for t in fields["ids"].split(",")] if fields.get("ids") else []
            if int(fields["first"]) == len(ids):
                ids.extend(chunk)
        return ids

    def requeue(
        self, rid: str, vid: str, incarnation: str | None = None, admitted_ms: int | None = None
    ) -> bool:
        """Hands a request running on `vid` back to its queue with its progress; False if
        it was not running there. With `incarnation` (and `admitted_ms`), only that claim
        of it: not one made since."""
        fence = ["*" if incarnation is None else incarnation]
        fence.append("*" if admitted_ms is None else str(admitted_ms))
        return bool(
            self._requeue(
                keys=[req_key(rid), owned_key(vid)],
                args=[vid, f"{PREFIX}queue:", GROUP, f"{PREFIX}queued:", rid, REQUEUED, *fence],
            )
        )

    def take_requeued(self, cls: str, count: int = 100) -> list[tuple[str, str]]:
        """Queue entries (entry_id, rid) of the class's requeued requests, oldest first,
        removed from the list."""
        items = self.r.lpop(f"{REQUEUED}{cls}", count) or []
        return [tuple(item.split(" ", 1)) for item in items]

    def owned(self, vid: str) -> list[str]:
        """Requests running on verifier `vid` (as Redis knows it)."""
        return sorted(self.r.smembers(owned_key(vid)))

    def running_on(self, vids: list[str]) -> set[str]:
        """Ids of the requests running on any of the verifiers `vids` (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        for vid in vids:
            pipe.smembers(owned_key(vid))
        return set().union(*pipe.execute()) if vids else set()

    def tenants(self, rids: list[str]) -> dict[str, str]:
        """The tenant of each request (empty: it has none, or it is gone); one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.hget(req_key(rid), "spec")
        specs = pipe.execute() if rids else []
        return {
            rid: json.loads(spec).get("tenant", "") if spec else ""
            for rid, spec in zip(rids, specs, strict=True)
        }

    def owners(self) -> list[str]:
        """Verifiers that may own running requests (registered or not)."""
        return sorted(self.r.smembers(OWNERS_KEY))

    def claims(self, vids: list[str]) -> list[Claim]:
        """The requests running on each of `vids`, as their records say (two round trips;
        a member of owned:{vid} that ended or moved on is left out)."""
        pipe = self.r.pipeline(transaction=False)
        for vid in vids:
            pipe.smembers(owned_key(vid))
        sets = pipe.execute()
        owned = [(vid, rid) for vid, rids in zip(vids, sets, strict=True) for rid in sorted(rids)]
        for _, rid in owned:
            pipe.hmget(req_key(rid), "status", "owner", "incarnation", "admitted_ms")
        claims = []
        for (vid, rid), (status, owner, inc, at) in zip(owned, pipe.execute(), strict=True):
            if status == "running" and owner == vid:
                claims.append(Claim(rid, vid, inc or "", int(at or 0)))
        return claims

    def forget_owner(self, vid: str) -> None:
        """Drops `vid` from the owners if it owns nothing (a request it claims re-adds it)."""
        if not self.r.exists(owned_key(vid)):
            self.r.srem(OWNERS_KEY, vid)

    def reclaim(self, cls: str, consumer: str, min_idle_ms: int) -> list[tuple[str, str]]:
        """Queue entries delivered to any consumer and idle for min_idle_ms, now this
        consumer's (XAUTOCLAIM): what a dead placement consumer read and never placed."""
        out, start = [], "0-0"
        while True:
            start, entries, *_ = self.r.xautoclaim(
                queue_key(cls), GROUP, consumer, min_idle_ms, start_id=start, count=100
            )
            out.extend((eid, fields["rid"]) for eid, fields in entries if fields)
            if start == "0-0":
                return out

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
            requeues=int(h.get("requeues", 0)),
            version=h.get("version", ""),
            pool=h.get("pool", ""),
            incarnation=h.get("incarnation", ""),
        )

    def commit_step(
        self,
        vid: str,
        steps: list[tuple[str, int, list[int]]],
        version: str = "",
        incarnation: str = "",
        max_unread: int = 0,
    ) -> list[tuple[StepState, int] | None]:
        """One round trip per step: for each running (rid, first_index, new ids) of verifier
        `vid` in its `incarnation` (serving model `version`), appends the ids to its output
        stream (see _COMMIT).
        Returns per request (state, generated): CANCELLED, LOST if `vid` no longer owns it
        (requeued elsewhere), PAUSED if it has generated more than `max_unread` (> 0) tokens
        past what its client was sent, else OK; None where the write failed (write it
        again)."""
        pipe = self.r.pipeline(transaction=False)
        for rid, first, ids in steps:
            self._commit(
                keys=[req_key(rid), out_key(rid)],
                args=[
                    vid,
                    first,
                    ",".join(map(str, ids)),
                    len(ids),
                    version,
                    incarnation,
                    max_unread,
                ],
                client=pipe,
            )
        results = pipe.execute(raise_on_error=False)
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
        return bool(
            self._finish(
                keys=[
                    req_key(rid),
                    out_key(rid),
                    queue_key(queue),
                    owned_key(vid),
                    session_key(session_id),
                ],
                args=[
                    vid,
                    status,
                    json.dumps(final),
                    final["usage"]["completion_tokens"],
                    GROUP,
                    vid if session_id else "",
                    rid,
                    RESULT_TTL_SECONDS,
                    incarnation,
                ],
            )
        )

    # --- gateway side ---------------------------------------------------------------------
    def mark_read(self, rid: str, sent: int) -> None:
        """Records that the gateway has sent the request's client its first `sent` tokens
        (the cursor a verifier pauses the request by)."""
        self._read(keys=[req_key(rid)], args=[sent])

    def tail(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Output-stream entries after last_id, waiting up to block_ms for the first."""
        resp = self.r.xread({out_key(rid): last_id}, block=block_ms, count=64)
        return [entry for _, entries in resp for entry in entries]

    def largest_verifier(self) -> tuple[int, int, int] | None:
        """(kv_budget, max_seq_len, block_size) of the live verifier with the largest KV
        budget."""
        rows = [v for v in self.live_verifiers() if "kv_budget" in v]
        if not rows:
            return None
        best = max(rows, key=lambda v: int(v["kv_budget"]))
        return (
            int(best["kv_budget"]),
            int(best.get("max_seq_len", 0)),
            int(best.get("block_size", 1)),
        )

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
    """Keeps a member registered (ttl: three periods) until `stop` is set; then removes it.
    A Redis outage logs one line when it starts and one when it ends."""
    outage = OutageLog(log, f"{kind} heartbeat")
    while not stop.is_set():
        try:
            store.heartbeat(member_id, info(), ttl_seconds=3 * period, kind=kind)
        except REDIS_UNREACHABLE as e:
            outage.failed(e)
        except Exception:
            log.exception("heartbeat failed", extra={"kind": kind})
        else:
            outage.succeeded()
        stop.wait(period)
    try:
        store.deregister(member_id, kind)
    except redis.RedisError:
        log.warning("deregistration failed; the entry expires", extra={"kind": kind})
