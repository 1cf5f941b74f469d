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

import itertools
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ..common.outage import REDIS_ERRORS, REDIS_UNREACHABLE, OutageLog

log = logging.getLogger(__name__)

PREFIX = "specserve:"
GROUP = "placement"
QUEUE_CLASSES = ("interactive", "batch")
ENDED = ("finished", "cancelled", "failed", "expired")
RESULT_TTL_SECONDS = 3600
# While Redis holds more than this share of its maxmemory, a request that ends is kept
# PRESSED_RESULT_TTL_SECONDS (long enough to re-attach and read its end), not an hour: what
# ended makes room for what runs. Admission reads Redis's memory at most every
# MEMORY_CHECK_SECONDS (a Submit each); a request's end reads it afresh (one INFO an end, so an
# end right after Redis filled is kept the minute, not the hour).
PRESSED_MEMORY_FRACTION = 0.5
PRESSED_RESULT_TTL_SECONDS = 60
MEMORY_CHECK_SECONDS = 0.5
# What a tenant stores is counted per minute over the last RESULT_TTL_SECONDS (what it made
# in that time is all Redis can still hold of it, running requests aside): a request counts
# its spec's JSON and STORED_BYTES_PER_TOKEN per token it may generate (the output stream).
STORED_BYTES_PER_TOKEN = 16


CLUSTER_SHARDS = 16  # shards of the request keys on Redis Cluster (fixed: it names keys)


class Layout:
    """Where each key lives.

    On one Redis (`cluster` False) the keys are the names above, in one shard. On Redis
    Cluster every key a script or a transaction touches carries a hash tag: a request's
    req and out keys share the tag of its shard (`shard_of`, one of CLUSTER_SHARDS) with
    that shard's queues, queued counters, requeued lists, owned sets and owners set, so each
    script touches one slot, and the shards spread over the masters. The registry
    (verifier:{id}, verifiers, drafter:{id}, drafters) shares the tag {registry}. Keys read
    and written one at a time (rollout, result, session) carry none."""

    def __init__(self, cluster: bool = False):
        self.cluster = cluster
        self.shards = CLUSTER_SHARDS if cluster else 1
        self._registry = f"{PREFIX}{{registry}}:" if cluster else PREFIX

    def _at(self, shard: int) -> str:
        return f"{PREFIX}{{{shard}}}:" if self.cluster else PREFIX

    def shard_of(self, rid: str) -> int:
        """The shard of a request: the same for every service and every process."""
        return zlib.crc32(rid.encode()) % self.shards if self.cluster else 0

    def req(self, rid: str) -> str:
        return f"{self._at(self.shard_of(rid))}req:{rid}"

    def out(self, rid: str) -> str:
        return f"{self._at(self.shard_of(rid))}out:{rid}"

    def queue(self, cls: str, shard: int = 0) -> str:
        return f"{self._at(shard)}queue:{cls}"

    def queued(self, cls: str, shard: int = 0) -> str:
        return f"{self._at(shard)}queued:{cls}"

    def requeued(self, cls: str, shard: int = 0) -> str:
        return f"{self._at(shard)}requeued:{cls}"

    def owned(self, vid: str, shard: int = 0) -> str:
        return f"{self._at(shard)}owned:{vid}"

    def owners(self, shard: int = 0) -> str:
        return f"{self._at(shard)}owners"

    def gateway_wake(self, gateway: str, reader: int, shard: int) -> str:
        """A gateway stream reader's wake key (in its shard's slot: one XREAD reads both)."""
        return f"{self._at(shard)}wake:{gateway}:{reader}"

    def member(self, kind: str, member_id: str) -> str:
        return f"{self._registry}{kind}:{member_id}"

    def members(self, kind: str) -> str:
        return f"{self._registry}{kind}s"

    def per_class(self, key: Callable[[str, int], str], shard: int) -> list[str]:
        """One key per queue class (in QUEUE_CLASSES order), for scripts that pick by class."""
        return [key(cls, shard) for cls in QUEUE_CLASSES]


def result_key(key: str) -> str:
    return f"{PREFIX}result:{key}"


def session_key(sid: str) -> str:
    return f"{PREFIX}session:{sid}"


ROLLOUT_KEY = f"{PREFIX}rollout"
SINGLE = Layout()  # the layout on one Redis


def req_key(rid: str) -> str:
    """The request's hash on one Redis (tests and tools; a store knows its own `layout`)."""
    return SINGLE.req(rid)


def queue_key(cls: str) -> str:
    return SINGLE.queue(cls)


def queued_key(cls: str) -> str:
    return SINGLE.queued(cls)


def _entry_order(entry: tuple[str, str]) -> tuple[int, int]:
    """Queue entries of several shards in the order they were added (stream ids are times)."""
    ms, _, seq = entry[0].partition("-")
    return int(ms), int(seq or 0)


def now_ms() -> int:
    return int(time.time() * 1000)


# Creates the request and queues it, unless it exists (idempotency) or the queue is full.
# Returns {code, waiting}: code 0 created, 1 existed, 2 queue full. A repeat writes a count
# (`submits`), so a WAIT after it covers the creation too (replication keeps its order).
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local fp = redis.call('HGET', KEYS[1], 'fingerprint')
  if fp and fp ~= '' and fp ~= (ARGV[7] or '') then return {3, 0} end
  redis.call('HINCRBY', KEYS[1], 'submits', 1)
  return {1, 0}
end
local waiting = tonumber(redis.call('GET', KEYS[3]) or '0')
if waiting >= tonumber(ARGV[3]) then return {2, waiting} end
local id = redis.call('XADD', KEYS[2], '*', 'rid', ARGV[6])
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'status', 'queued', 'queue', ARGV[4],
           'entry_id', id, 'created_ms', ARGV[5], 'generated', 0, 'fingerprint', ARGV[7] or '')
redis.call('INCR', KEYS[3])
return {0, waiting}
"""

# Lua: the place (0-based) of a queue class in QUEUE_CLASSES. Scripts that act on the queue
# a request records take one key per class, in that order, and pick theirs by it.
_CLASS_INDEX = (
    "local function class_index(q)\n"
    + "".join(f"  if q == '{c}' then return {i} end\n" for i, c in enumerate(QUEUE_CLASSES))
    + "  return error('unknown queue class ' .. tostring(q))\nend\n"
)

# Moves a queued request ARGV[3] to running on verifier ARGV[1], incarnation ARGV[6] (model
# version ARGV[4], pool ARGV[5]), admitted at ARGV[2]. KEYS: req, the owner's owned set,
# owners, then the queued counter of each class. Returns 1 if claimed, 0 if not queued, 2 if
# it generated tokens on another version.
_CLAIM = (
    _CLASS_INDEX
    + """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
local version = redis.call('HGET', KEYS[1], 'version')
if version and version ~= ARGV[4]
   and tonumber(redis.call('HGET', KEYS[1], 'generated')) > 0 then return 2 end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[1], 'admitted_ms', ARGV[2],
           'version', ARGV[4], 'pool', ARGV[5], 'incarnation', ARGV[6])
local counter = KEYS[4 + class_index(redis.call('HGET', KEYS[1], 'queue'))]
if tonumber(redis.call('GET', counter) or '0') > 0 then redis.call('DECR', counter) end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""
)

# One step of a running request, by its owner ARGV[1] in incarnation ARGV[6] (model version
# ARGV[5]): ids ARGV[3] (comma list, ARGV[4] of them) from index ARGV[2], and when ARGV[8] is
# not empty each id's log-probabilities (a ';' list, one per id; see verifier/logprobs.py).
# Only the part past `generated` is appended: a retried write that went through before
# appends nothing, one that went through in part appends the rest.
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
  local skip = generated - first + 1
  local fields = {'first', generated, 'ids', table.concat(ids, ',', skip), 'v', ARGV[5]}
  if ARGV[8] ~= '' then
    local lps = {}
    for t in string.gmatch(ARGV[8], '[^;]+') do lps[#lps + 1] = t end
    fields[#fields + 1] = 'lp'
    fields[#fields + 1] = table.concat(lps, ';', skip)
  end
  redis.call('XADD', KEYS[2], '*', unpack(fields))
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

# Ends a running request ARGV[6] owned by ARGV[1] in incarnation ARGV[8] with status ARGV[2]
# and final ARGV[3] (after ARGV[4] tokens); KEYS[3] is its queue (group ARGV[5]), KEYS[4] the
# owner's set; the request's keys expire after ARGV[7] seconds.
# Returns 1, or 0 if the caller does not own it (someone else finishes it). A repeat by the
# owner that ended it (a retry) returns 1 and writes a count (`finishes`), so a WAIT after it
# covers the end too.
_FINISH = """
local mine = redis.call('HGET', KEYS[1], 'owner') == ARGV[1]
   and (redis.call('HGET', KEYS[1], 'incarnation') or '') == ARGV[8]
local status = redis.call('HGET', KEYS[1], 'status')
if mine and status ~= 'running' and status ~= 'queued' and status then
  redis.call('HINCRBY', KEYS[1], 'finishes', 1)
  return 1
end
if status ~= 'running' or not mine then return 0 end
redis.call('XADD', KEYS[2], '*', 'first', ARGV[4], 'ids', '', 'final', ARGV[3])
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'final', ARGV[3])
local e = redis.call('HGET', KEYS[1], 'entry_id')
redis.call('XACK', KEYS[3], ARGV[5], e)
redis.call('XDEL', KEYS[3], e)
redis.call('SREM', KEYS[4], ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 1
"""

# Puts a running request owned by ARGV[1] back in its queue (a new entry; the old one is acked
# and deleted; the new one also listed in requeued:{class}), keeping its progress. KEYS[2] is
# the owner's set, then per class (QUEUE_CLASSES order) come the queues, the queued counters
# and the requeued lists (group ARGV[2]). Only the claim of request ARGV[3] by incarnation
# ARGV[4] admitted at ARGV[5] ('*': any) is requeued. Returns 1, or 0 if it is not running
# there (ended, already requeued, or claimed since by another incarnation or again).
_REQUEUE = (
    _CLASS_INDEX
    + """
local n = (#KEYS - 2) / 3  -- queue classes
if redis.call('HGET', KEYS[1], 'status') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  redis.call('SREM', KEYS[2], ARGV[3])
  return 0
end
if (ARGV[4] ~= '*' and (redis.call('HGET', KEYS[1], 'incarnation') or '') ~= ARGV[4])
   or (ARGV[5] ~= '*' and redis.call('HGET', KEYS[1], 'admitted_ms') ~= ARGV[5]) then
  return 0
end
local c = class_index(redis.call('HGET', KEYS[1], 'queue'))
local queue = KEYS[3 + c]
local e = redis.call('HGET', KEYS[1], 'entry_id')
redis.call('XACK', queue, ARGV[2], e)
redis.call('XDEL', queue, e)
local id = redis.call('XADD', queue, '*', 'rid', ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'queued', 'owner', '', 'entry_id', id)
redis.call('HINCRBY', KEYS[1], 'requeues', 1)
redis.call('INCR', KEYS[3 + n + c])
redis.call('SREM', KEYS[2], ARGV[3])
redis.call('RPUSH', KEYS[3 + 2 * n + c], id .. ' ' .. ARGV[3])
return 1
"""
)

# Ends a queued request now with status ARGV[4] (cancelled, expired) and final ARGV[1] (group
# ARGV[2]; its keys expire after ARGV[3] s); with ARGV[5] == '1' a running one gets the cancel
# flag its verifier reads. KEYS: req, out, then per class
# (QUEUE_CLASSES order) the queues and the queued counters.
# Returns {state, owner}: state 0 already ended/unknown, 1 was queued (ended now), 2 running.
_END_QUEUED = (
    _CLASS_INDEX
    + """
local n = (#KEYS - 2) / 2  -- queue classes
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'status', ARGV[4], 'final', ARGV[1])
  local generated = redis.call('HGET', KEYS[1], 'generated') or 0
  redis.call('XADD', KEYS[2], '*', 'first', generated, 'ids', '', 'final', ARGV[1])
  local c = class_index(redis.call('HGET', KEYS[1], 'queue'))
  local e = redis.call('HGET', KEYS[1], 'entry_id')
  redis.call('XACK', KEYS[3 + c], ARGV[2], e)
  redis.call('XDEL', KEYS[3 + c], e)
  local counter = KEYS[3 + n + c]
  if tonumber(redis.call('GET', counter) or '0') > 0 then redis.call('DECR', counter) end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  return {1, ''}
elseif st == 'running' and ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'cancel', 1)
  return {2, redis.call('HGET', KEYS[1], 'owner')}
end
return {0, ''}
"""
)


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

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        probe: redis.Redis | RedisCluster | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ):
        self.r = client
        self._probe = probe or client  # health checks: one try, short timeouts
        self.layout = Layout(cluster=isinstance(client, RedisCluster))
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)
        self._end_queued = client.register_script(_END_QUEUED)
        self._commit = client.register_script(_COMMIT)
        self._finish = client.register_script(_FINISH)
        self._requeue = client.register_script(_REQUEUE)
        self._read = client.register_script(_READ)
        self._memory = (-MEMORY_CHECK_SECONDS, 0.0)  # (when read, used / maxmemory)

    @classmethod
    def from_url(
        cls,
        url: str,
        cluster: bool = False,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        retries: int = 10,
    ) -> RequestStore:
        """A client that rides out a short Redis outage: a command that meets a dropped
        connection is retried `retries` times with exponential backoff (with the default 10,
        about 6 s in all) before it fails.
        Every write here is safe to repeat (scripts check state; steps are written by index).
        With `cluster`, `url` names one node of a Redis Cluster (the client finds the rest and
        follows slots as they move); with `wait_replicas`, a request's creation and its end
        are acknowledged only once that many replicas hold them (`NotReplicated` if not
        within `wait_timeout_ms`)."""
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries)
        kwargs: dict[str, Any] = dict(
            decode_responses=True,
            socket_connect_timeout=2,
            socket_timeout=10,
            retry=retry,
        )
        if cluster:
            client, probe = (
                _cluster_client(url, **kwargs),
                _cluster_client(url, socket_connect_timeout=1, socket_timeout=1),
            )
        else:
            client = redis.Redis.from_url(
                url,
                health_check_interval=10,
                retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                **kwargs,
            )
            probe = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        return cls(client, probe, wait_replicas, wait_timeout_ms)

    @classmethod
    def connect(cls, settings: Any, url: str | None = None) -> RequestStore:
        """The store a service's settings name (`redis_url` unless `url` is given,
        `redis_cluster`, `redis_wait_*`)."""
        return cls.from_url(
            url or settings.redis_url,
            cluster=settings.redis_cluster,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        )

    def wait_reachable(self, period_cap: float = 5.0) -> None:
        """Blocks until Redis answers, logging each miss: a service that starts before
        Redis waits for it (not serving meanwhile) instead of failing."""
        delay = 0.2
        while not self.ping():
            log.warning("redis unreachable; waiting", extra={"retry_in_s": delay})
            time.sleep(delay)
            delay = min(period_cap, delay * 2)

    def ping(self) -> bool:
        """True if Redis answers now (on Redis Cluster: every master)."""
        try:
            if self.layout.cluster:
                return bool(self._probe.ping(target_nodes=RedisCluster.PRIMARIES))
            return bool(self._probe.ping())
        except REDIS_ERRORS:
            return False

    def ensure_queues(self) -> None:
        """Creates the queues and their consumer group, and the queued counters if missing
        (from the entries not yet delivered: a store written before the counters existed)."""
        for shard, cls in itertools.product(range(self.layout.shards), QUEUE_CLASSES):
            queue, queued = self.layout.queue(cls, shard), self.layout.queued(cls, shard)
            try:
                self.r.xgroup_create(queue, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            if not self.r.exists(queued):
                pending = int(self.r.xpending(queue, GROUP)["pending"])
                self.r.set(queued, self.r.xlen(queue) - pending, nx=True)

    def _each_shard(self, command: Callable[[Any, int], Any]) -> list[Any]:
        """`command(pipe, shard)` for every shard, in one round trip (per node); the replies
        in shard order."""
        pipe = self.r.pipeline(transaction=False)
        for shard in range(self.layout.shards):
            command(pipe, shard)
        return pipe.execute()

    def _durable(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Runs a script; with `wait_replicas`, then WAITs on the same connection (WAIT
        counts only the writes of its own connection) until that many replicas hold the
        writes. NotReplicated if fewer did within the timeout: the write may still be there
        (every caller's write is safe to repeat), but it was not acknowledged."""
        if not self.wait_replicas:
            return script(keys=keys, args=args)
        for attempt in (0, 1):
            if self.layout.cluster:
                node = self.r.get_node_from_key(keys[0])
                pipe = node.redis_connection.pipeline(transaction=False)
            else:
                pipe = self.r.pipeline(transaction=False)
            script(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            try:
                result, acked = pipe.execute()
            except redis.exceptions.MovedError:  # the slot moved: learn where, once
                if attempt or not self.layout.cluster:
                    raise
                self.r.nodes_manager.initialize()
                continue
            if int(acked) < self.wait_replicas:
                raise NotReplicated(
                    f"{acked} of {self.wait_replicas} replicas acknowledged the write within "
                    f"{self.wait_timeout_ms} ms; retry"
                )
            return result
        raise AssertionError("unreachable")

    # --- scheduler side -------------------------------------------------------------------
    def create(
        self, rid: str, spec: dict[str, Any], cls: str, limit: int, fingerprint: str = ""
    ) -> tuple[int, int]:
        """Persists and queues a request. Returns (code, waiting): 0 created, 1 existed (with
        the same `fingerprint`, what the request asks, or one not known: ""), 2 full, 3 the id
        is taken by a request with another fingerprint. On Redis Cluster the limit holds per
        shard: `limit` / CLUSTER_SHARDS (rounded up)."""
        at = self.layout
        shard = at.shard_of(rid)
        if self.layout.shards > 1:
            limit = -(-limit // self.layout.shards)
        code, waiting = self._durable(
            self._create,
            [at.req(rid), at.queue(cls, shard), at.queued(cls, shard)],
            [json.dumps(spec), GROUP, limit, cls, now_ms(), rid, fingerprint],
        )
        return int(code), int(waiting)

    def read_queue(self, cls: str, consumer: str, count: int) -> list[tuple[str, str]]:
        """New (undelivered) queue entries of a class as (entry_id, request_id), oldest first
        (on Redis Cluster up to `count` from each shard)."""
        return self._read_group(cls, consumer, ">", count)

    def pending_entries(self, cls: str, consumer: str, count: int = 100) -> list[tuple[str, str]]:
        """Entries delivered to this consumer but not yet acked (placed or waiting)."""
        return self._read_group(cls, consumer, "0", count)

    def _read_group(self, cls: str, consumer: str, start: str, count: int) -> list[tuple[str, str]]:
        replies = self._each_shard(
            lambda pipe, shard: pipe.xreadgroup(
                GROUP, consumer, {self.layout.queue(cls, shard): start}, count=count
            )
        )
        out = [(eid, f["rid"]) for resp in replies for _, got in resp for eid, f in got if f]
        return sorted(out, key=_entry_order)

    def cancel(self, rid: str, final: dict[str, Any]) -> tuple[int, str]:
        """Ends a queued request, flags a running one. Returns (state, owner) as _END_QUEUED."""
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

    def queued_before(self, cls: str, cutoff_ms: int, count: int) -> list[str]:
        """Request ids of the class's queue entries created before cutoff_ms (oldest first;
        entries of running requests are among them until they end)."""
        replies = self._each_shard(
            lambda pipe, shard: pipe.xrange(
                self.layout.queue(cls, shard), "-", cutoff_ms, count=count
            )
        )
        entries = [(eid, f.get("rid", "")) for reply in replies for eid, f in reply]
        return [rid for _, rid in sorted(entries, key=_entry_order)[:count] if rid]

    def waiting_count(self, cls: str) -> int:
        """Requests of the class queued and not yet running."""
        counts = self._each_shard(lambda pipe, shard: pipe.get(self.layout.queued(cls, shard)))
        return sum(int(n or 0) for n in counts)

    def live_verifiers(self) -> list[dict[str, str]]:
        """Registered verifiers whose heartbeat has not expired."""
        return self.live("verifier")

    def live(self, kind: str) -> list[dict[str, str]]:
        """Registered members of a kind (verifier, drafter) whose heartbeat has not expired."""
        ids = sorted(self.r.smembers(self.layout.members(kind)))
        pipe = self.r.pipeline(transaction=False)
        for member in ids:
            pipe.hgetall(self.layout.member(kind, member))
        out = []
        for member, info in zip(ids, pipe.execute(), strict=True):
            if info:
                out.append({"id": member, **info})
            else:
                self.r.srem(self.layout.members(kind), member)
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
        pipe.sadd(self.layout.members(kind), member_id)
        pipe.hset(self.layout.member(kind, member_id), mapping=info)
        pipe.pexpire(self.layout.member(kind, member_id), int(ttl_seconds * 1000))
        pipe.execute()

    def deregister(self, member_id: str, kind: str = "verifier") -> None:
        self.r.srem(self.layout.members(kind), member_id)
        self.r.delete(self.layout.member(kind, member_id))

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

    def progress(self, rid: str) -> list[int]:
        """The tokens generated so far, from the output stream (placed by index, so a
        repeated entry counts once)."""
        ids: list[int] = []
        for _, fields in self.r.xrange(self.layout.out(rid)):
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
        at = self.layout
        shard = at.shard_of(rid)
        keys = [at.req(rid), at.owned(vid, shard)]
        for key in (at.queue, at.queued, at.requeued):
            keys += at.per_class(key, shard)
        return bool(self._requeue(keys=keys, args=[vid, GROUP, rid, *fence]))

    def take_requeued(self, cls: str, count: int = 100) -> list[tuple[str, str]]:
        """Queue entries (entry_id, rid) of the class's requeued requests, oldest first,
        removed from the list."""
        replies = self._each_shard(
            lambda pipe, shard: pipe.lpop(self.layout.requeued(cls, shard), count)
        )
        entries = [tuple(item.split(" ", 1)) for items in replies for item in items or []]
        return sorted(entries, key=_entry_order)

    def owned(self, vid: str) -> list[str]:
        """Requests running on verifier `vid` (as Redis knows it)."""
        return sorted(self.running_on([vid]))

    def _owned_sets(self, vids: list[str]) -> list[set[str]]:
        """The requests each of `vids` owns, over every shard (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        for vid in vids:
            for shard in range(self.layout.shards):
                pipe.smembers(self.layout.owned(vid, shard))
        sets, n = pipe.execute() if vids else [], self.layout.shards
        return [set().union(*sets[k * n : (k + 1) * n]) for k in range(len(vids))]

    def running_on(self, vids: list[str]) -> set[str]:
        """Ids of the requests running on any of the verifiers `vids` (one round trip)."""
        return set().union(*self._owned_sets(vids))

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

    def owners(self) -> list[str]:
        """Verifiers that may own running requests (registered or not)."""
        sets = self._each_shard(lambda pipe, shard: pipe.smembers(self.layout.owners(shard)))
        return sorted(set().union(*sets))

    def claims(self, vids: list[str]) -> list[Claim]:
        """The requests running on each of `vids`, as their records say (two round trips;
        a member of owned:{vid} that ended or moved on is left out)."""
        sets = self._owned_sets(vids)
        owned = [(vid, rid) for vid, rids in zip(vids, sets, strict=True) for rid in sorted(rids)]
        pipe = self.r.pipeline(transaction=False)
        for _, rid in owned:
            pipe.hmget(self.layout.req(rid), "status", "owner", "incarnation", "admitted_ms")
        claims = []
        for (vid, rid), (status, owner, inc, at) in zip(owned, pipe.execute(), strict=True):
            if status == "running" and owner == vid:
                claims.append(Claim(rid, vid, inc or "", int(at or 0)))
        return claims

    def forget_owner(self, vid: str) -> None:
        """Drops `vid` from the owners if it owns nothing (a request it claims re-adds it)."""
        for shard in range(self.layout.shards):
            if not self.r.exists(self.layout.owned(vid, shard)):
                self.r.srem(self.layout.owners(shard), vid)

    def reclaim(self, cls: str, consumer: str, min_idle_ms: int) -> list[tuple[str, str]]:
        """Queue entries delivered to any consumer and idle for min_idle_ms, now this
        consumer's (XAUTOCLAIM): what a dead placement consumer read and never placed."""
        out = []
        for shard in range(self.layout.shards):
            queue, start = self.layout.queue(cls, shard), "0-0"
            while True:
                start, entries, *_ = self.r.xautoclaim(
                    queue, GROUP, consumer, min_idle_ms, start_id=start, count=100
                )
                out.extend((eid, fields["rid"]) for eid, fields in entries if fields)
                if start == "0-0":
                    break
        return sorted(out, key=_entry_order)

    def memory_fraction(self, max_age: float = MEMORY_CHECK_SECONDS) -> float:
        """How full Redis is: used_memory / maxmemory of its fullest node (0 with no
        maxmemory), at most max_age seconds old."""
        read_at, fraction = self._memory
        if time.monotonic() - read_at < max_age:
            return fraction
        if isinstance(self.r, RedisCluster):  # (a dict per node)
            info = self.r.info("memory", target_nodes=RedisCluster.PRIMARIES)
        else:
            info = self.r.info("memory")
        nodes = [info] if "used_memory" in info else list(info.values())
        fraction = max(
            (
                n["used_memory"] / n["maxmemory"]
                for n in nodes
                if isinstance(n, dict) and n.get("maxmemory")
            ),
            default=0.0,
        )
        self._memory = (time.monotonic(), fraction)
        return fraction

    def result_ttl(self) -> int:
        """How long a request that ends now is kept (see PRESSED_MEMORY_FRACTION)."""
        try:
            pressed = self.memory_fraction(max_age=0) > PRESSED_MEMORY_FRACTION
        except REDIS_ERRORS:
            pressed = False
        return PRESSED_RESULT_TTL_SECONDS if pressed else RESULT_TTL_SECONDS

    @staticmethod
    def _stored_keys(tenant: str, minute: int) -> list[str]:
        """A tenant's per-minute byte counters of the last hour, newest first (one hash tag:
        one slot on Redis Cluster)."""
        span = RESULT_TTL_SECONDS // 60
        return [f"{PREFIX}stored:{{{tenant}}}:{m}" for m in range(minute, minute - span, -1)]

    def stored_bytes(self, tenant: str) -> int:
        """About how many bytes a tenant's requests of the last hour hold (see
        STORED_BYTES_PER_TOKEN)."""
        keys = self._stored_keys(tenant, int(time.time() // 60))
        return sum(int(v) for v in self.r.mget(keys) if v)

    def add_stored_bytes(self, tenant: str, nbytes: int) -> None:
        key = self._stored_keys(tenant, int(time.time() // 60))[0]
        pipe = self.r.pipeline(transaction=False)
        pipe.incrby(key, nbytes)
        pipe.expire(key, RESULT_TTL_SECONDS + 60)
        pipe.execute()

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
        `version`), appends the ids to its output stream (see _COMMIT).
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

    def _pipelined(self, script: Any, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Runs a script once per (keys, args), in one round trip per Redis node; a call
        that failed has its error in its place. (A cluster pipeline cannot carry scripts:
        the calls go on a plain pipeline to the master of their slot, and one that meets a
        moved slot or a lost master is tried once more alone, through the cluster client,
        which follows the slot.)"""
        if not self.layout.cluster:
            pipe = self.r.pipeline(transaction=False)
            for keys, args in calls:
                script(keys=keys, args=args, client=pipe)
            return pipe.execute(raise_on_error=False) if calls else []
        by_node: dict[str, tuple[Any, list[int]]] = {}
        results: list[Any] = [None] * len(calls)
        for k, (keys, _) in enumerate(calls):
            try:
                node = self.r.get_node_from_key(keys[0])
            except REDIS_ERRORS as e:
                results[k] = e
                continue
            by_node.setdefault(node.name, (node, []))[1].append(k)
        for node, ks in by_node.values():
            pipe = node.redis_connection.pipeline(transaction=False)
            for k in ks:
                script(keys=calls[k][0], args=calls[k][1], client=pipe)
            try:
                out = pipe.execute(raise_on_error=False)
            except REDIS_ERRORS as e:
                out = [e] * len(ks)
            for k, result in zip(ks, out, strict=True):
                results[k] = result
        for k, result in enumerate(results):
            if isinstance(result, REDIS_ERRORS):
                try:
                    results[k] = script(keys=calls[k][0], args=calls[k][1])
                except REDIS_ERRORS as e:
                    results[k] = e
        return results

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
                self.r.set(session_key(session_id), vid, ex=RESULT_TTL_SECONDS)
            except REDIS_ERRORS:
                log.warning("session hint not written", extra={"request_id": rid})
        return bool(done)

    # --- gateway side ---------------------------------------------------------------------
    def mark_read(self, rid: str, sent: int) -> None:
        """Records that the gateway has sent the request's client its first `sent` tokens
        (the cursor a verifier pauses the request by)."""
        self._read(keys=[self.layout.req(rid)], args=[sent])

    def mark_read_many(self, cursors: dict[str, int]) -> list[str]:
        """mark_read for many requests in one round trip (per node); the ids whose write
        failed."""
        calls = [([self.layout.req(rid)], [sent]) for rid, sent in cursors.items()]
        results = self._pipelined(self._read, calls)
        return [rid for rid, r in zip(cursors, results, strict=True) if isinstance(r, Exception)]

    def tail(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Output-stream entries after last_id, waiting up to block_ms for the first."""
        resp = self.r.xread({self.layout.out(rid): last_id}, block=block_ms, count=64)
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


class NotReplicated(redis.ConnectionError):
    """Fewer replicas than `wait_replicas` acknowledged a write in time: it is not
    acknowledged (a ConnectionError: callers treat it as Redis being away, and retry)."""


class _Cluster(RedisCluster):
    """A RedisCluster client that relearns the slot map whenever a command cannot reach its
    node (at most every RELEARN_SECONDS). Its own relearning misses a path: a blocking XREAD
    to a master that died kept failing long after its replica had taken over."""

    RELEARN_SECONDS = 0.5
    _relearned = 0.0

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except REDIS_UNREACHABLE:
            if time.monotonic() - self._relearned > self.RELEARN_SECONDS:
                self._relearned = time.monotonic()
                try:
                    self.nodes_manager.initialize()
                except REDIS_ERRORS:
                    pass  # no node answers yet: the next failure tries again
            raise


def _cluster_client(url: str, **kwargs: Any) -> RedisCluster:
    """A Redis Cluster client from one node's URL; waits for the cluster to answer (a service
    that starts before Redis waits for it), logging each miss."""
    delay = 0.2
    while True:
        try:
            return _Cluster.from_url(url, **kwargs)
        except REDIS_ERRORS as e:
            log.warning(
                "redis cluster unreachable; waiting", extra={"retry_in_s": delay, "error": str(e)}
            )
            time.sleep(delay)
            delay = min(5.0, delay * 2)


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
    except REDIS_ERRORS:
        log.warning("deregistration failed; the entry expires", extra={"kind": kind})
