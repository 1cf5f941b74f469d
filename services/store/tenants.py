"""What Redis holds per tenant and API key: key records, quotas, and the audit trail.

Owns apikey:<key id> and apikeys (the records `specserve keys` and the gateway's seeding
write), quota:{<key id>} and streams:{<key id>} (a key's request and token buckets and its
open streams, changed only by the quota scripts so that concurrent gateways share one limit),
and audit (one entry per Generate call). See schema.KEYS. What a key means (its format, its
digest, its tier's limits, the errors a caller sees) is the gateway's: gateway/keys.py.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from . import scripts
from .connection import Connection
from .schema import AUDIT_STREAM, KEY_IDS, STREAM_MAX_AGE_MS, key_record, now_ms, quota_keys


class QuotaCode(IntEnum):
    """What a quota script says (scripts.ADMIT, scripts.TAKE_TOKENS)."""

    ADMITTED = 0
    REQUESTS = 1  # the requests per minute are used up
    TOKENS = 2  # the tokens per minute are used up
    STREAMS = 3  # the concurrent streams are all open


class Tenants(Connection):
    """API key records, quota buckets and stream slots, the audit stream."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        register = self.r.register_script
        self._admit = register(scripts.ADMIT)
        self._take_tokens = register(scripts.TAKE_TOKENS)
        self._release = register(scripts.RELEASE)

    # --- API key records --------------------------------------------------------------------
    def put_api_key(self, key_id: str, record: dict[str, Any], keep_revoked: bool) -> None:
        """Stores a key's record; with `keep_revoked` (and no `revoked` in the record), what
        Redis says of a key stored before is kept (a key new to Redis is live)."""
        # One transaction on one Redis; on Redis Cluster two slots: the record first (one
        # HSET: a key revoked in the file is never stored live, even for a moment).
        pipe = self.r.pipeline(transaction=not self.layout.cluster)
        pipe.hset(key_record(key_id), mapping=record)
        if keep_revoked:
            pipe.hsetnx(key_record(key_id), "revoked", 0)
        pipe.sadd(KEY_IDS, key_id)
        pipe.execute()

    def revoke_api_key(self, key_id: str) -> bool:
        """Marks a key revoked; False if there is no such key."""
        if not self.r.exists(key_record(key_id)):
            return False
        self.r.hset(key_record(key_id), "revoked", 1)
        return True

    def api_key(self, key_id: str) -> dict[str, str]:
        """A key's record; empty if there is none."""
        return self.r.hgetall(key_record(key_id))

    def api_keys(self) -> list[tuple[str, dict[str, str]]]:
        """Every key's id and record, by id."""
        rows = []
        for key_id in sorted(self.r.smembers(KEY_IDS)):
            record = self.r.hgetall(key_record(key_id))
            if record:
                rows.append((key_id, record))
        return rows

    # --- quotas -----------------------------------------------------------------------------
    def quota_admit(
        self, key_id: str, rpm: int, tpm: int, streams: int, stream_id: str, new_request: bool
    ) -> tuple[QuotaCode, int]:
        """Opens stream `stream_id` of a key that allows `streams` at once and, for a new
        request, takes one of its `rpm` requests per minute; or takes nothing. Returns
        (code, retry after ms) as scripts.ADMIT."""
        code, retry_ms = self._admit(
            keys=quota_keys(key_id),
            args=[now_ms(), rpm, tpm, streams, stream_id, STREAM_MAX_AGE_MS, int(new_request)],
        )
        return QuotaCode(int(code)), int(retry_ms)

    def quota_take_tokens(
        self, key_id: str, rpm: int, tpm: int, tokens: int
    ) -> tuple[QuotaCode, int]:
        """Takes `tokens` from a key's bucket of `tpm` per minute, or nothing. Returns
        (code, retry after ms) as scripts.TAKE_TOKENS."""
        code, retry_ms = self._take_tokens(
            keys=quota_keys(key_id)[:1], args=[now_ms(), rpm, tpm, tokens]
        )
        return QuotaCode(int(code)), int(retry_ms)

    def quota_release(self, key_id: str, stream_id: str, unused_tokens: int, tpm: int) -> None:
        """Closes a stream and gives back `unused_tokens` (the bucket holds at most tpm)."""
        self._release(keys=quota_keys(key_id), args=[stream_id, max(0, unused_tokens), tpm])

    def quota_touch(self, streams: list[tuple[str, str]]) -> None:
        """Marks open streams, as (key id, stream id), alive; a slot given back (or aged out)
        is not taken again. One round trip."""
        now = now_ms()
        pipe = self.r.pipeline(transaction=False)
        for key_id, sid in streams:
            zset = quota_keys(key_id)[1]
            pipe.zadd(zset, {sid: now}, xx=True)
            pipe.pexpire(zset, STREAM_MAX_AGE_MS)
        pipe.execute()

    # --- the audit trail --------------------------------------------------------------------
    def append_audit(self, fields: dict[str, str], max_entries: int) -> None:
        """Adds an entry to the audit stream, which keeps about the last `max_entries`."""
        self.r.xadd(AUDIT_STREAM, fields, maxlen=max_entries, approximate=True)
