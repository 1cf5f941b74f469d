"""API keys, tenants and per-key quotas, held in Redis so that every gateway shares them.

A key reads `ssk_<id>_<secret>`. Redis keeps, under `specserve:apikey:<id>`, the SHA-256 of
the whole key (never the key), its tenant, tier and limits; a presented key is looked up by
its id and compared by digest in constant time.

Quotas per key, enforced in Lua scripts so that concurrent gateways share one limit:
requests per minute and tokens per minute (token buckets that refill continuously; a request
takes one request and a stream slot before any work is done for it, then, once tokenized,
prompt + max_tokens tokens, and what it did not generate is given back when it ends), and
open streams (a sorted set of stream ids; entries of a gateway that died age out).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml
from redis.cluster import RedisCluster

from ..common.settings import Tier
from ..store import PREFIX, now_ms

KEY_PREFIX = "ssk"
TENANT = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
STREAM_MAX_AGE_MS = 3600 * 1000  # a stream entry older than this is taken for a dead gateway
STREAM_TOUCH_SECONDS = 300.0  # how often a gateway marks its open streams alive (well under)


def key_record(key_id: str) -> str:
    return f"{PREFIX}apikey:{key_id}"


KEY_IDS = f"{PREFIX}apikeys"


def quota_keys(key_id: str) -> list[str]:
    """A key's request/token buckets and its open streams: one hash tag, so the quota
    scripts touch one slot on Redis Cluster."""
    return [f"{PREFIX}quota:{{{key_id}}}", f"{PREFIX}streams:{{{key_id}}}"]


class AuthError(Exception):
    """The call is not authenticated (no key, a malformed, unknown or revoked key)."""


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, through one key, with that key's limits."""

    key_id: str
    tenant: str
    tier: str
    limits: Tier | None  # None: no limits (auth off)

    def scoped(self, request_id: str) -> str:
        """The request id as stored: a tenant's ids cannot meet another tenant's."""
        return f"{self.tenant}:{request_id}" if self.tenant else request_id


ANONYMOUS = Principal(key_id="", tenant="", tier="", limits=None)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def split_key(key: str) -> str:
    """The key's id; AuthError if it is not shaped like one of ours."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        raise AuthError("the API key is malformed; it reads ssk_<id>_<secret>")
    return parts[1]


# Both buckets refilled to now (they share one timestamp). KEYS[1]: bucket hash; ARGV[1-3]:
# now_ms, rpm, tpm.
_REFILL = """
local now, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts')
local req, tok, ts = tonumber(b[1]) or rpm, tonumber(b[2]) or tpm, tonumber(b[3]) or now
local elapsed = math.max(0, now - ts)
req = math.min(rpm, req + elapsed * rpm / 60000)
tok = math.min(tpm, tok + elapsed * tpm / 60000)
redis.call('HSET', KEYS[1], 'req', req, 'tok', tok, 'ts', now)
redis.call('PEXPIRE', KEYS[1], 120000)
"""

# Opens a stream slot of a key and, for a new request, takes one request from its bucket; or
# takes nothing. KEYS: bucket hash, streams zset. ARGV: now_ms, rpm, tpm, concurrent limit,
# stream id, stream max age ms, a new request (1/0). Returns {0, 0} admitted, else
# {1 rpm | 3 streams, retry after ms}.
_ADMIT = (
    _REFILL
    + """
if ARGV[7] == '1' and req < 1 then return {1, math.ceil((1 - req) * 60000 / rpm)} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[6]))
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return {3, 1000} end
redis.call('ZADD', KEYS[2], now, ARGV[5])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]))
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'req', req - 1) end
return {0, 0}
"""
)

# Takes ARGV[4] tokens from a key's token bucket, or nothing. KEYS: bucket hash. ARGV: now_ms,
# rpm, tpm, tokens. Returns {0, 0} taken, else {2, retry after ms}.
_TAKE_TOKENS = (
    _REFILL
    + """
local want = tonumber(ARGV[4])
if tok < want then return {2, math.ceil((want - tok) * 60000 / tpm)} end
redis.call('HSET', KEYS[1], 'tok', tok - want)
return {0, 0}
"""
)

# Ends a stream: frees its slot and gives back ARGV[2] unused tokens (capped at ARGV[3]).
_RELEASE = """
redis.call('ZREM', KEYS[2], ARGV[1])
local tok = tonumber(redis.call('HGET', KEYS[1], 'tok'))
if tok then
  redis.call('HSET', KEYS[1], 'tok', math.min(tonumber(ARGV[3]), tok + tonumber(ARGV[2])))
end
return 1
"""


class KeyStore:
    """API keys and quotas in Redis (`specserve keys` and the gateway)."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._admit = client.register_script(_ADMIT)
        self._take_tokens = client.register_script(_TAKE_TOKENS)
        self._release = client.register_script(_RELEASE)

    # --- keys -------------------------------------------------------------------------------
    def create(
        self,
        tenant: str,
        tier: str,
        limits: Tier,
        key: str | None = None,
        revoked: bool | None = False,
    ) -> str:
        """Stores a key (a new random one unless `key` is given) and returns it; only its
        digest is kept. `revoked` None keeps what Redis says of a key stored before (a key
        new to Redis is live)."""
        if not TENANT.fullmatch(tenant):
            raise ValueError(f"tenant {tenant!r}: 1 to 63 of a-z, 0-9 and -, starting alphanumeric")
        if key is None:
            key = f"{KEY_PREFIX}_{secrets.token_hex(6)}_{secrets.token_hex(24)}"
        key_id = split_key(key)
        record = {
            "digest": digest(key),
            "tenant": tenant,
            "tier": tier,
            "created_ms": now_ms(),
            **{name: int(value) for name, value in limits.model_dump().items()},
        }
        if revoked is not None:
            record["revoked"] = int(revoked)
        # One transaction on one Redis; on Redis Cluster two slots: the record first (one
        # HSET: a key revoked in the file is never stored live, even for a moment).
        pipe = self.r.pipeline(transaction=not isinstance(self.r, RedisCluster))
        pipe.hset(key_record(key_id), mapping=record)
        if revoked is None:
            pipe.hsetnx(key_record(key_id), "revoked", 0)
        pipe.sadd(KEY_IDS, key_id)
        pipe.execute()
        return key

    def revoke(self, key_id: str) -> bool:
        """Revokes a key by id; False if there is no such key."""
        if not self.r.exists(key_record(key_id)):
            return False
        self.r.hset(key_record(key_id), "revoked", 1)
        return True

    def list(self) -> list[dict[str, str]]:
        """Every key's id, tenant, tier, limits and state (never the key or its digest)."""
        rows = []
        for key_id in sorted(self.r.smembers(KEY_IDS)):
            record = self.r.hgetall(key_record(key_id))
            if record:
                record.pop("digest", None)
                rows.append({"id": key_id, **record})
        return rows

    def seed(self, path: str | Path, tiers: dict[str, Tier]) -> int:
        """Stores the keys listed in a YAML file ([{key, tenant, tier, revoked}]); returns how
        many. Every gateway start seeds, so seeding never un-revokes: a key revoked in Redis
        (`specserve keys revoke`) stays revoked, and `revoked: true` in the file revokes."""
        entries = yaml.safe_load(Path(path).read_text()) or []
        for entry in entries:
            tier = entry.get("tier", "standard")
            if tier not in tiers:
                raise ValueError(f"{path}: unknown tier {tier!r} (known: {sorted(tiers)})")
            revoked = entry.get("revoked", False)
            if not isinstance(revoked, bool):
                raise ValueError(f"{path}: revoked must be true or false, not {revoked!r}")
            self.create(
                entry["tenant"], tier, tiers[tier], key=entry["key"], revoked=revoked or None
            )
        return len(entries)

    def authenticate(self, key: str) -> Principal:
        key_id = split_key(key)
        record = self.r.hgetall(key_record(key_id))
        presented = digest(key)
        if not record:
            hmac.compare_digest(presented, presented)  # the same work as a known id
            raise AuthError("the API key is not valid")
        if not hmac.compare_digest(presented, record["digest"]):
            raise AuthError("the API key is not valid")
        if record.get("revoked") == "1":
            raise AuthError("the API key was revoked")
        limits = Tier(
            requests_per_minute=int(record["requests_per_minute"]),
            tokens_per_minute=int(record["tokens_per_minute"]),
            concurrent_streams=int(record["concurrent_streams"]),
            max_tokens=int(record["max_tokens"]),
            batch=record["batch"] == "1",
        )
        return Principal(key_id, record["tenant"], record["tier"], limits)

    # --- quotas -----------------------------------------------------------------------------
    def admit(self, who: Principal, stream_id: str, new_request: bool) -> None:
        """Opens a stream for `who`; a new request also takes one request (its tokens are
        taken by `take_tokens` once it is tokenized). QuotaExceeded (with when to retry) if a
        limit is reached; nothing is taken then."""
        limits = who.limits
        if limits is None:
            return
        code, retry_ms = self._admit(
            keys=quota_keys(who.key_id),
            args=[
                now_ms(),
                limits.requests_per_minute,
                limits.tokens_per_minute,
                limits.concurrent_streams,
                stream_id,
                STREAM_MAX_AGE_MS,
                int(new_request),
            ],
        )
        self._raise_for(code, retry_ms, limits)

    def take_tokens(self, who: Principal, tokens: int) -> None:
        """Takes a new request's tokens (prompt + max_tokens); QuotaExceeded if the bucket
        holds fewer (nothing is taken then)."""
        limits = who.limits
        if limits is None:
            return
        if tokens > limits.tokens_per_minute:
            raise QuotaExceeded(
                f"the request needs {tokens} tokens (prompt + max_tokens), more than this key's "
                f"{limits.tokens_per_minute} tokens per minute; lower max_tokens",
                retry_after_ms=0,
            )
        code, retry_ms = self._take_tokens(
            keys=quota_keys(who.key_id)[:1],
            args=[now_ms(), limits.requests_per_minute, limits.tokens_per_minute, tokens],
        )
        self._raise_for(code, retry_ms, limits)

    @staticmethod
    def _raise_for(code: int, retry_ms: int, limits: Tier) -> None:
        if code == 1:
            why = f"{limits.requests_per_minute} requests per minute"
        elif code == 2:
            why = f"{limits.tokens_per_minute} tokens per minute"
        elif code == 3:
            why = f"{limits.concurrent_streams} concurrent streams"
        else:
            return
        seconds = math.ceil(retry_ms / 100) / 10
        raise QuotaExceeded(
            f"this key's quota of {why} is used up; retry in {seconds:g}s", int(retry_ms)
        )

    def release(self, who: Principal, stream_id: str, unused_tokens: int = 0) -> None:
        """Closes a stream and gives back the tokens its request reserved and did not use."""
        if who.limits is None:
            return
        self._release(
            keys=quota_keys(who.key_id),
            args=[stream_id, max(0, unused_tokens), who.limits.tokens_per_minute],
        )

    def touch(self, streams: list[tuple[str, str]]) -> None:
        """Marks open streams, as (key id, stream id), alive: only a dead gateway's age out,
        however long a stream runs. A slot given back (or aged out) is not taken again."""
        if not streams:
            return
        now = now_ms()
        pipe = self.r.pipeline(transaction=False)
        for key_id, sid in streams:
            zset = quota_keys(key_id)[1]
            pipe.zadd(zset, {sid: now}, xx=True)
            pipe.pexpire(zset, STREAM_MAX_AGE_MS)
        pipe.execute()


def stream_id() -> str:
    """An id for one open stream (a request may be streamed more than once)."""
    return f"{int(time.time() * 1000)}-{secrets.token_hex(4)}"
