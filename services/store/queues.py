"""The queues requests wait in, and who holds what was taken from them.

Owns the reads of queue:<class> (a stream per class and shard, read by the scheduler as the
consumer group `placement`), queued:<class> (how many wait), requeued:<class> (requests put
back, placed ahead of their class), and the owned:<vid> and owners sets (which verifier runs
which request). The scripts in requests.py write them as a request moves; this module creates
the queues and reads them (see schema.KEYS).

On Redis Cluster each of these is one key per shard: a read here reads every shard in one
round trip per node and merges the entries in the order they were added.
"""

from __future__ import annotations

import itertools

import redis

from .connection import Connection
from .requests import Claim
from .schema import GROUP, QUEUE_CLASSES


def _entry_order(entry: tuple[str, str]) -> tuple[int, int]:
    """Queue entries of several shards in the order they were added (stream ids are times)."""
    ms, _, seq = entry[0].partition("-")
    return int(ms), int(seq or 0)


class Queues(Connection):
    """The queues (the scheduler's) and the owned sets (the reaper's)."""

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

    # --- reading the queues -----------------------------------------------------------------
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

    def take_requeued(self, cls: str, count: int = 100) -> list[tuple[str, str]]:
        """Queue entries (entry_id, rid) of the class's requeued requests, oldest first,
        removed from the list."""
        replies = self._each_shard(
            lambda pipe, shard: pipe.lpop(self.layout.requeued(cls, shard), count)
        )
        entries = [tuple(item.split(" ", 1)) for items in replies for item in items or []]
        return sorted(entries, key=_entry_order)

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

    # --- who runs what ----------------------------------------------------------------------
    def owned(self, vid: str) -> list[str]:
        """Requests running on verifier `vid` (as Redis knows it)."""
        return sorted(self.running_on([vid]))

    def running_on(self, vids: list[str]) -> set[str]:
        """Ids of the requests running on any of the verifiers `vids` (one round trip)."""
        return set().union(*self._owned_sets(vids))

    def _owned_sets(self, vids: list[str]) -> list[set[str]]:
        """The requests each of `vids` owns, over every shard (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        for vid in vids:
            for shard in range(self.layout.shards):
                pipe.smembers(self.layout.owned(vid, shard))
        sets, n = pipe.execute() if vids else [], self.layout.shards
        return [set().union(*sets[k * n : (k + 1) * n]) for k in range(len(vids))]

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
