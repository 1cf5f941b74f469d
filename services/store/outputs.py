"""A request's output as its readers see it: reading out:<id>, and saying how far its client
has read.

The gateway streams a request's output to its client (gateway/tails.py): it blocks in one
XREAD on many out keys and a wake key of its own (wake:<gateway>:<reader>, which this module
writes to make that read return), and records in the request's hash (`read`) how many tokens
it has sent, the cursor a verifier pauses the request by. Operator tools read the output one
request at a time (`tail`). See schema.KEYS.
"""

from __future__ import annotations

from typing import Any

from . import scripts
from .connection import Connection
from .schema import WAKE_TTL_MS

Entry = tuple[str, dict[str, str]]  # (stream entry id, fields)


class Outputs(Connection):
    """Reads of output streams, and the read cursors."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._read = self.r.register_script(scripts.READ)

    def tail(self, rid: str, last_id: str, block_ms: int) -> list[Entry]:
        """Output-stream entries after last_id, waiting up to block_ms for the first."""
        resp = self.r.xread({self.layout.out(rid): last_id}, block=block_ms, count=64)
        return [entry for _, entries in resp for entry in entries]

    def read_streams(
        self, after: dict[str, str], block_ms: int, count: int
    ) -> list[tuple[str, list[Entry]]]:
        """One XREAD of many streams (by key: `layout.out` or `layout.gateway_wake`, all of
        one shard): up to `count` entries of each after its last id, waiting up to block_ms
        for any. Returns (key, entries) for each stream that had some."""
        return self.r.xread(after, block=block_ms, count=count)

    def wake(self, wake_key: str) -> None:
        """Writes a reader's wake stream (one entry, kept WAKE_TTL_MS): its blocked
        `read_streams` returns."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(wake_key, {"w": 1}, maxlen=1, approximate=False)
        pipe.pexpire(wake_key, WAKE_TTL_MS)
        pipe.execute()

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
