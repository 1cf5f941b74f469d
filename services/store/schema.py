"""The Redis schema: every key the services share, where it lives, and its name.

This is the contract between the processes that share Redis. `KEYS` lists each kind of key:
its pattern (after PREFIX, on one Redis), its Redis type, its owner (the service that creates
it and answers for it), who writes it and how, how long it lives, and the module of store/
whose code reads and writes it. Nothing outside store/ builds a key name: a service asks the
store (or `Layout` and the functions below) for one.

Where a key lives (`Layout`): on one Redis every key is PREFIX + its pattern. On Redis
Cluster a key that a script or a transaction touches together with others carries a hash
tag (`tag`), so that the script touches one slot:
- "shard": a request's req and out keys share the tag of its shard (`Layout.shard_of`, one
  of CLUSTER_SHARDS) with that shard's queues, queued counters, requeued lists, owned sets,
  owners set and gateway wake keys: `specserve:{<shard>}:req:<id>`. The shards spread
  over the masters.
- "registry": verifier and drafter entries and their sets: `specserve:{registry}:verifiers`.
- "own": the tag is in the pattern on one Redis as well (`stored:{<tenant>}:...`).
- "": read and written one at a time (rollout, result, session, api keys, audit).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "specserve:"
GROUP = "placement"  # the queues' consumer group (the scheduler's placement)
QUEUE_CLASSES = ("interactive", "batch")
ENDED = ("finished", "cancelled", "failed", "expired")  # a request's final statuses
CLUSTER_SHARDS = 16  # shards of the request keys on Redis Cluster (fixed: it names keys)

# How long keys live.
RESULT_TTL_SECONDS = 3600  # a request's keys once it ended; session hints; stored bytes
PRESSED_RESULT_TTL_SECONDS = 60  # the same while Redis is pressed (see results.py)
WAKE_TTL_MS = 60_000  # a gateway reader's wake stream
QUOTA_TTL_MS = 120_000  # a key's quota buckets (refilled in full by then)
STREAM_MAX_AGE_MS = 3600 * 1000  # an open stream's quota slot (older: a dead gateway's)

ENDS = (
    "none while queued or running; RESULT_TTL_SECONDS from its end "
    "(PRESSED_RESULT_TTL_SECONDS while Redis is pressed)"
)


@dataclass(frozen=True)
class Key:
    """One kind of key in Redis."""

    pattern: str  # after PREFIX, on one Redis; <...> is a variable part
    type: str  # the Redis type
    owner: str  # the service that creates it and answers for it
    writers: str  # who writes it, and with what
    ttl: str  # how long it lives
    module: str  # the module of store/ whose code reads and writes it
    holds: str  # what it holds
    tag: str = ""  # its hash tag on Redis Cluster (see the module docstring)


KEYS = (
    # --- requests: one hash and one output stream each, and the queues they wait in -------
    Key(
        pattern="req:<id>",
        type="hash",
        owner="scheduler",
        writers="scheduler (create, cancel, end_queued), verifier (claim, commit_step, "
        "finish), scheduler and verifier (requeue), gateway (`read`)",
        ttl=ENDS,
        module="requests",
        holds="spec (the SubmitRequest, in the proto's JSON mapping), status, queue, "
        "entry_id, owner, incarnation (of the owner), cancel, generated, created_ms, "
        "admitted_ms, requeues, final (JSON), version and pool (of the verifier that claimed "
        "it last), fingerprint, submits, finishes, read (tokens the gateway has sent its "
        "client; absent: nobody streams it through a gateway)",
        tag="shard",
    ),
    Key(
        pattern="out:<id>",
        type="stream",
        owner="verifier (the one running the request)",
        writers="verifier (commit_step, finish); scheduler (the final entry of a request "
        "that ends while queued)",
        ttl=ENDS,
        module="requests",
        holds="one entry per step: first (absolute index), ids (comma list), v (the model "
        "version that produced them), lp (log-probabilities, when asked for); the last entry "
        "has final (JSON). Only the owner appends, and only at index `generated`: a retried "
        "or stale write is dropped",
        tag="shard",
    ),
    Key(
        pattern="queue:<class>",
        type="stream",
        owner="scheduler",
        writers="scheduler (create; reads it as group `placement`; ends queued requests), "
        "verifier (finish acks and deletes the entry), requeue (a new entry)",
        ttl="none",
        module="queues",
        holds="one entry per queued request (field rid); acked and deleted when the request "
        "ends or is requeued",
        tag="shard",
    ),
    Key(
        pattern="queued:<class>",
        type="string (int)",
        owner="scheduler",
        writers="scheduler (create, end_queued, cancel), verifier (claim), requeue",
        ttl="none",
        module="queues",
        holds="requests of the class with status queued (the queue length limit)",
        tag="shard",
    ),
    Key(
        pattern="requeued:<class>",
        type="list",
        owner="scheduler",
        writers="requeue (pushes), scheduler (take_requeued pops)",
        ttl="none",
        module="queues",
        holds="`entry_id rid` of requests put back in the queue, for the scheduler to place "
        "ahead of their class",
        tag="shard",
    ),
    Key(
        pattern="owned:<verifier id>",
        type="set",
        owner="verifier",
        writers="verifier (claim, finish), requeue",
        ttl="none",
        module="queues",
        holds="ids of the requests running on the verifier",
        tag="shard",
    ),
    Key(
        pattern="owners",
        type="set",
        owner="scheduler",
        writers="verifier (claim adds), scheduler (forget_owner removes)",
        ttl="none",
        module="queues",
        holds="verifier ids that may own running requests (the reaper reads it)",
        tag="shard",
    ),
    Key(
        pattern="wake:<gateway>:<reader>",
        type="stream",
        owner="gateway",
        writers="gateway (a stream opened or freed: wake the reader)",
        ttl="WAKE_TTL_MS",
        module="outputs",
        holds="one entry (w), written to make the reader's blocked XREAD return",
        tag="shard",
    ),
    # --- the registry: who serves, found by heartbeats ------------------------------------
    Key(
        pattern="verifier:<id>",
        type="hash",
        owner="verifier",
        writers="verifier (heartbeat, deregister)",
        ttl="three heartbeat periods",
        module="registry",
        holds="address, incarnation, model, version, pool, config, capacity, running, "
        "batch_capacity, batch_running, kv_budget (tokens), block_size, kv_blocks, kv_used, "
        "kv_cached, kv_free (blocks), prefixes (comma list of short hashes of its cached "
        "blocks), max_seq_len, request_ids (comma list of the requests it runs), listed_ms "
        "(when it listed them)",
        tag="registry",
    ),
    Key(
        pattern="verifiers",
        type="set",
        owner="verifier",
        writers="verifier (heartbeat, deregister); any reader drops a member that expired",
        ttl="none",
        module="registry",
        holds="registered verifier ids",
        tag="registry",
    ),
    Key(
        pattern="drafter:<id>",
        type="hash",
        owner="drafter",
        writers="drafter (heartbeat, deregister)",
        ttl="three heartbeat periods",
        module="registry",
        holds="address, proposer, pool",
        tag="registry",
    ),
    Key(
        pattern="drafters",
        type="set",
        owner="drafter",
        writers="drafter (heartbeat, deregister); any reader drops a member that expired",
        ttl="none",
        module="registry",
        holds="registered drafter ids",
        tag="registry",
    ),
    Key(
        pattern="rollout",
        type="hash",
        owner="operator (`specserve rollout`)",
        writers="operator (set_canary_share)",
        ttl="none",
        module="registry",
        holds="canary_share (of new requests placed on the canary pool), previous_share, "
        "updated_ms",
    ),
    # --- what outlives a request: results, session hints, stored bytes --------------------
    Key(
        pattern="result:<hash>",
        type="hash",
        owner="gateway",
        writers="gateway (cache_result)",
        ttl="the gateway's result cache TTL",
        module="results",
        holds="ids, final (JSON) of a finished deterministic request (the result cache)",
    ),
    Key(
        pattern="session:<session id>",
        type="string",
        owner="verifier",
        writers="verifier (finish)",
        ttl="RESULT_TTL_SECONDS",
        module="results",
        holds="id of the verifier the session's last turn finished on (a hint)",
    ),
    Key(
        pattern="stored:{<tenant>}:<minute>",
        type="string (int)",
        owner="scheduler",
        writers="scheduler (add_stored_bytes)",
        ttl="RESULT_TTL_SECONDS + 60 s",
        module="results",
        holds="bytes stored by the tenant's requests created in that minute",
        tag="own",
    ),
    # --- tenants: API keys, quotas, the audit trail -----------------------------------------
    Key(
        pattern="apikey:<key id>",
        type="hash",
        owner="operator (`specserve keys`)",
        writers="operator (create, revoke), gateway (seeds api_keys_file at start)",
        ttl="none",
        module="tenants",
        holds="digest (SHA-256 of the whole key, never the key), tenant, tier, created_ms, "
        "revoked, and the tier's limits",
    ),
    Key(
        pattern="apikeys",
        type="set",
        owner="operator (`specserve keys`)",
        writers="operator, gateway (with apikey:<key id>)",
        ttl="none",
        module="tenants",
        holds="every key id",
    ),
    Key(
        pattern="quota:{<key id>}",
        type="hash",
        owner="gateway",
        writers="gateway (the quota scripts)",
        ttl="QUOTA_TTL_MS",
        module="tenants",
        holds="req, tok (the request and token buckets), ts (when they were refilled)",
        tag="own",
    ),
    Key(
        pattern="streams:{<key id>}",
        type="sorted set",
        owner="gateway",
        writers="gateway (the quota scripts, touch)",
        ttl="STREAM_MAX_AGE_MS",
        module="tenants",
        holds="the key's open streams, scored by when they were last marked alive (those of "
        "a dead gateway age out)",
        tag="own",
    ),
    Key(
        pattern="audit",
        type="stream",
        owner="gateway",
        writers="gateway (one entry per Generate call)",
        ttl="none (capped at audit_max_entries)",
        module="tenants",
        holds="tenant, key_id, request_id, client, protocol, priority, prompt_tokens, "
        "output_tokens, resumed, status, duration_ms: never prompt or output text",
    ),
)


class Layout:
    """Where each key lives, on one Redis (`cluster` False) or on Redis Cluster (see the
    module docstring)."""

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
        """A registry entry: kind is verifier or drafter."""
        return f"{self._registry}{kind}:{member_id}"

    def members(self, kind: str) -> str:
        return f"{self._registry}{kind}s"

    def per_class(self, key: Callable[[str, int], str], shard: int) -> list[str]:
        """One key per queue class (in QUEUE_CLASSES order), for scripts that pick by class."""
        return [key(cls, shard) for cls in QUEUE_CLASSES]


SINGLE = Layout()  # the layout on one Redis


def req_key(rid: str) -> str:
    """The request's hash on one Redis (tests and tools; a store knows its own `layout`)."""
    return SINGLE.req(rid)


def queue_key(cls: str) -> str:
    return SINGLE.queue(cls)


def queued_key(cls: str) -> str:
    return SINGLE.queued(cls)


# Keys without a hash tag: the same on one Redis and on Redis Cluster.
ROLLOUT_KEY = f"{PREFIX}rollout"
KEY_IDS = f"{PREFIX}apikeys"
AUDIT_STREAM = f"{PREFIX}audit"


def result_key(key: str) -> str:
    return f"{PREFIX}result:{key}"


def session_key(sid: str) -> str:
    return f"{PREFIX}session:{sid}"


def stored_keys(tenant: str, minute: int) -> list[str]:
    """A tenant's per-minute byte counters of the last RESULT_TTL_SECONDS, newest first (one
    hash tag: one slot on Redis Cluster)."""
    span = RESULT_TTL_SECONDS // 60
    return [f"{PREFIX}stored:{{{tenant}}}:{m}" for m in range(minute, minute - span, -1)]


def key_record(key_id: str) -> str:
    """An API key's record."""
    return f"{PREFIX}apikey:{key_id}"


def quota_keys(key_id: str) -> list[str]:
    """An API key's request/token buckets and its open streams: one hash tag, so the quota
    scripts touch one slot on Redis Cluster."""
    return [f"{PREFIX}quota:{{{key_id}}}", f"{PREFIX}streams:{{{key_id}}}"]


def now_ms() -> int:
    """The schema's clock: every *_ms field is milliseconds since the epoch."""
    return int(time.time() * 1000)
