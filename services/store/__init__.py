"""Everything the services keep in Redis, and the only package that talks to it.

A service holds one `RequestStore` and calls its methods; nothing outside this package
touches the Redis client or builds a key name. The store is made of one part per concern,
each a module that says what it owns:

    schema.py      every key: pattern, type, owner, TTL, writers (KEYS); where it lives
                   (Layout); the constants and key names
    scripts.py     every Lua script, with its contract (KEYS, ARGV, returns, guarantees)
    connection.py  the Redis client (one Redis or Redis Cluster), retries, replication
    requests.py    a request's life: create, claim, commit_step, finish, requeue, cancel
    queues.py      the queues a request waits in, and who runs what was taken from them
    outputs.py     a request's output as the gateway reads it, and its read cursor
    registry.py    verifiers and drafters by heartbeat; the rollout's canary share
    results.py     the result cache, session hints, stored bytes, memory pressure
    tenants.py     API key records, quotas, the audit trail
    acl.py         a Redis user per service, with the keys and commands it needs
    ownership.py   the rule that finds orphans (requests no live verifier runs)
"""

from .connection import Connection, NotReplicated
from .outputs import Outputs
from .queues import Queues
from .registry import Registry, heartbeat_forever
from .requests import Claim, RequestLifecycle, RequestRecord, StepState, spec_json
from .results import STORED_BYTES_PER_TOKEN, Results
from .schema import (
    AUDIT_STREAM,
    CLUSTER_SHARDS,
    ENDED,
    GROUP,
    KEY_IDS,
    KEYS,
    PREFIX,
    QUEUE_CLASSES,
    STREAM_MAX_AGE_MS,
    Layout,
    key_record,
    now_ms,
    queue_key,
    queued_key,
    quota_keys,
    req_key,
    result_key,
    session_key,
)
from .tenants import QuotaCode, Tenants


class RequestStore(RequestLifecycle, Outputs, Queues, Registry, Results, Tenants):
    """Redis as the services share it: `RequestStore.connect(settings)`, or
    `RequestStore(client)` over a client of one Redis or a Redis Cluster. Each base is one
    concern (see the package docstring); they share the connection (its arguments:
    `Connection`), and a request's end asks results.py how long to keep it."""


__all__ = [
    "AUDIT_STREAM",
    "CLUSTER_SHARDS",
    "ENDED",
    "GROUP",
    "KEYS",
    "KEY_IDS",
    "PREFIX",
    "QUEUE_CLASSES",
    "STORED_BYTES_PER_TOKEN",
    "STREAM_MAX_AGE_MS",
    "Claim",
    "Connection",
    "Layout",
    "NotReplicated",
    "QuotaCode",
    "RequestRecord",
    "RequestStore",
    "StepState",
    "heartbeat_forever",
    "key_record",
    "now_ms",
    "queue_key",
    "queued_key",
    "quota_keys",
    "req_key",
    "result_key",
    "session_key",
    "spec_json",
]
