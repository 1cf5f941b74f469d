"""What outlives a request, and how much room it takes: the result cache, session hints,
each tenant's stored bytes, and how full Redis is.

Owns result:<hash> (the result cache), session:<sid> (which verifier holds a session's
cached prefix), and stored:{<tenant>}:<minute> (bytes a tenant's requests stored). See
schema.KEYS.

Memory pressure: while Redis holds more than PRESSED_MEMORY_FRACTION of its maxmemory, a
request that ends is kept PRESSED_RESULT_TTL_SECONDS (long enough to re-attach and read its
end), not RESULT_TTL_SECONDS: what ended makes room for what runs. Admission reads Redis's
memory at most every MEMORY_CHECK_SECONDS (a Submit each); a request's end reads it afresh
(one INFO an end, so an end right after Redis filled is kept the minute, not the hour).

Stored bytes: what a tenant stores is counted per minute over the last RESULT_TTL_SECONDS
(what it made in that time is all Redis can still hold of it, running requests aside): a
request counts its spec's JSON and STORED_BYTES_PER_TOKEN per token it may generate (the
output stream).
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..common.outage import REDIS_ERRORS
from .connection import Connection
from .schema import (
    PRESSED_RESULT_TTL_SECONDS,
    RESULT_TTL_SECONDS,
    result_key,
    session_key,
    stored_keys,
)

PRESSED_MEMORY_FRACTION = 0.5
MEMORY_CHECK_SECONDS = 0.5
STORED_BYTES_PER_TOKEN = 16


class Results(Connection):
    """The result cache, session hints, stored bytes and memory pressure."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._memory = (-MEMORY_CHECK_SECONDS, 0.0)  # (when read, used / maxmemory)

    # --- the result cache (the gateway's) ---------------------------------------------------
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

    # --- session hints ----------------------------------------------------------------------
    def session_owner(self, sid: str) -> str | None:
        """The verifier holding the session's cached prefix, if any."""
        return self.r.get(session_key(sid)) if sid else None

    def set_session_owner(self, sid: str, vid: str) -> None:
        """The session's next turn is to go to verifier `vid` (its last turn ended there)."""
        self.r.set(session_key(sid), vid, ex=RESULT_TTL_SECONDS)

    # --- stored bytes (the scheduler's) -----------------------------------------------------
    def stored_bytes(self, tenant: str) -> int:
        """About how many bytes a tenant's requests of the last hour hold (see
        STORED_BYTES_PER_TOKEN)."""
        keys = stored_keys(tenant, int(time.time() // 60))
        return sum(int(v) for v in self.r.mget(keys) if v)

    def add_stored_bytes(self, tenant: str, nbytes: int) -> None:
        key = stored_keys(tenant, int(time.time() // 60))[0]
        pipe = self.r.pipeline(transaction=False)
        pipe.incrby(key, nbytes)
        pipe.expire(key, RESULT_TTL_SECONDS + 60)
        pipe.execute()

    # --- memory pressure --------------------------------------------------------------------
    def memory_fraction(self, max_age: float = MEMORY_CHECK_SECONDS) -> float:
        """How full Redis is: used_memory / maxmemory of its fullest node (0 with no
        maxmemory), at most max_age seconds old."""
        read_at, fraction = self._memory
        if time.monotonic() - read_at < max_age:
            return fraction
        fraction = max(
            (n["used_memory"] / n["maxmemory"] for n in self.memory_info() if n.get("maxmemory")),
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
