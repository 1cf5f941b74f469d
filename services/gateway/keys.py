"""API keys, tenants and per-key quotas, held in Redis so that every gateway shares them.

A key reads `ssk_<id>_<secret>`. Redis keeps, under its id (store.schema: apikey:<id>), the
SHA-256 of the whole key (never the key), its tenant, tier and limits; a presented key is
looked up by its id and compared by digest in constant time.

Quotas per key, enforced in Lua scripts (store.scripts) so that concurrent gateways share one
limit:
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
from typing import Any

import yaml

from ..common.settings import Tier
from ..store import QuotaCode, RequestStore, now_ms

KEY_PREFIX = "ssk"
TENANT = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
STREAM_TOUCH_SECONDS = 300.0  # how often a gateway marks its open streams alive (well under
# store.STREAM_MAX_AGE_MS, after which a stream is taken for a dead gateway's)


class AuthError(Exception):
    """The call is not authenticated (no key, a malformed, unknown or revoked key)."""


class QuotaExceeded(Exception):
    """A key's limit is reached: retry after `retry_after_ms`; None: the request can never
    pass this key's limits as it stands (it asks for more than a whole minute's tokens)."""

    def __init__(self, message: str, retry_after_ms: int | None):
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


class KeyStore:
    """API keys and quotas (`specserve keys` and the gateway), kept in Redis by the store
    (store/tenants.py)."""

    def __init__(self, store: RequestStore | Any):
        """`store`: the RequestStore, or a Redis client (tools and tests), which is wrapped
        in one."""
        self.store = store if isinstance(store, RequestStore) else RequestStore(store)

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
        self.store.put_api_key(key_id, record, keep_revoked=revoked is None)
        return key

    def revoke(self, key_id: str) -> bool:
        """Revokes a key by id; False if there is no such key."""
        return self.store.revoke_api_key(key_id)

    def list(self) -> list[dict[str, str]]:
        """Every key's id, tenant, tier, limits and state (never the key or its digest)."""
        rows = []
        for key_id, record in self.store.api_keys():
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
        record = self.store.api_key(key_id)
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
        code, retry_ms = self.store.quota_admit(
            who.key_id,
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.concurrent_streams,
            stream_id,
            new_request,
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
                retry_after_ms=None,
            )
        code, retry_ms = self.store.quota_take_tokens(
            who.key_id, limits.requests_per_minute, limits.tokens_per_minute, tokens
        )
        self._raise_for(code, retry_ms, limits)

    @staticmethod
    def _raise_for(code: QuotaCode, retry_ms: int, limits: Tier) -> None:
        if code == QuotaCode.REQUESTS:
            why = f"{limits.requests_per_minute} requests per minute"
        elif code == QuotaCode.TOKENS:
            why = f"{limits.tokens_per_minute} tokens per minute"
        elif code == QuotaCode.STREAMS:
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
        self.store.quota_release(who.key_id, stream_id, unused_tokens, who.limits.tokens_per_minute)

    def touch(self, streams: list[tuple[str, str]]) -> None:
        """Marks open streams, as (key id, stream id), alive: only a dead gateway's age out,
        however long a stream runs. A slot given back (or aged out) is not taken again."""
        if streams:
            self.store.quota_touch(streams)


def stream_id() -> str:
    """An id for one open stream (a request may be streamed more than once)."""
    return f"{int(time.time() * 1000)}-{secrets.token_hex(4)}"
