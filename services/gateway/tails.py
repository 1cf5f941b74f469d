"""The output of every stream a gateway has open, from a few blocking reads.

A stream does not poll Redis. Each reader thread holds up to STREAMS_PER_READER open streams
of one shard (one on a single Redis; on Redis Cluster a shard's out keys share a slot, so one
XREAD may name them all) and blocks in one XREAD on all their out keys at once, plus a wake
key of its own. It hands each stream's entries to that stream's queue on the gateway's event
loop. Opening a stream adds its key to a reader and writes the reader's wake key, so the
blocked XREAD returns and the next one includes it; a closed stream's key is left out of the
next read.

Memory stays bounded per stream: a reader leaves out of its reads a stream that holds
MAX_BACKLOG batches its client has not taken (the verifier pauses a request whose client does
not read, so its entries wait in Redis, not here); taking from a full backlog wakes the reader.
A Redis outage: the reader retries every half second, waking its streams each time, and a
stream's `outage_seconds` says for how long its reader's reads have been failing, for it to
give up after its limit.

A waiting stream holds one future and nothing else: no queue, no timer. (With thousands of
streams, what each wait allocates lives until the next token and is promoted through the
garbage collector's generations; the collections that follow pause every stream.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..common.outage import REDIS_ERRORS, OutageLog
from ..store import RequestStore

log = logging.getLogger(__name__)

STREAMS_PER_READER = 256
BLOCK_MS = 1000  # how long a read blocks with no output (it returns on any key's entry)
COUNT = 64  # entries per key per read
MAX_BACKLOG = 64  # batches a stream's queue holds before its reader leaves it out


@dataclass(eq=False)
class Tail:
    """One open stream: the request, where its reads are, and the batches read for it."""

    rid: str
    key: str  # its output stream, as the store names it (store.layout.out)
    last_id: str
    backlog: deque = field(default_factory=deque)  # batches read, not yet taken (loop-owned)
    reader: _Reader | None = None
    _waiter: asyncio.Future | None = None

    async def get(self) -> list[tuple[str, dict[str, str]]] | None:
        """The next batch of entries; None when woken without one (its reader's reads are
        failing: see `outage_seconds`). A cancel while waiting is never swallowed, even by a
        batch that arrives in the same loop turn: the batch stays for the next get."""
        if not self.backlog:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self.backlog:
                return None
        batch = self.backlog.popleft()
        if len(self.backlog) == MAX_BACKLOG - 1 and self.reader is not None:
            self.reader.wake()  # it may have left this stream out while its backlog was full
        return batch

    def put(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        """Adds a batch (on the event loop)."""
        self.backlog.append(entries)
        self.poke()

    def poke(self) -> None:
        """Wakes a waiting `get` (on the event loop)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def outage_seconds(self) -> float:
        """How long its reader's reads have been failing (0: they are not)."""
        since = self.reader.failing_since if self.reader else 0.0
        return time.monotonic() - since if since else 0.0


@dataclass(eq=False)
class _Reader:
    tails: Tails
    shard: int
    wake_key: str
    streams: dict[str, Tail] = field(default_factory=dict)  # out key -> its stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    has_streams: threading.Event = field(default_factory=threading.Event)
    wake_id: str = "0-0"  # the last wake entry read (a wake written at any time is seen)
    failing_since: float = 0.0  # monotonic time its reads began failing; 0: they do not

    def add(self, tail: Tail) -> None:
        with self.lock:
            self.streams[tail.key] = tail
            tail.reader = self
            self.has_streams.set()
        self.wake()

    def remove(self, tail: Tail) -> None:
        with self.lock:
            if self.streams.get(tail.key) is tail:
                del self.streams[tail.key]

    def wake(self) -> None:
        """Makes a blocked read return (so the next one reads the streams as they are now),
        off the caller's thread (the event loop's)."""
        self.tails.wakes.submit(self._wake)

    def _wake(self) -> None:
        try:
            self.tails.store.wake(self.wake_key)
        except REDIS_ERRORS:
            pass  # the read returns within BLOCK_MS anyway

    def run(self) -> None:
        outage = OutageLog(log, "stream reads")
        while not self.tails.stopped.is_set():
            try:
                self._read_once(outage)
            except Exception:  # not Redis: a bug; the streams wait, the reader goes on
                log.exception("stream read failed")
                self.tails.stopped.wait(0.5)

    def _read_once(self, outage: OutageLog) -> None:
        if not self.has_streams.wait(timeout=1.0):
            return
        with self.lock:
            live = [t for t in self.streams.values() if len(t.backlog) < MAX_BACKLOG]
            if not self.streams:
                self.has_streams.clear()
                return
        keys = {t.key: t.last_id for t in live}
        keys[self.wake_key] = self.wake_id
        try:
            resp = self.tails.store.read_streams(keys, BLOCK_MS, COUNT)
        except REDIS_ERRORS as e:
            outage.failed(e)
            self.failing_since = self.failing_since or time.monotonic()
            with self.lock:
                waiting = list(self.streams.values())
            self.tails.loop.call_soon_threadsafe(_poke, waiting)  # to look at outage_seconds
            self.tails.stopped.wait(0.5)
            return
        outage.succeeded()
        self.failing_since = 0.0
        batches = []
        for key, entries in resp:
            if key == self.wake_key:
                self.wake_id = entries[-1][0] if entries else self.wake_id
                continue
            with self.lock:
                tail = self.streams.get(key)
            if tail is None or not entries:
                continue  # a stream closed meanwhile
            tail.last_id = entries[-1][0]
            batches.append((tail, entries))
        if batches:  # (one wake of the loop for the whole read, not one per stream)
            self.tails.loop.call_soon_threadsafe(_deliver, batches)


def _deliver(batches: list[tuple[Tail, list]]) -> None:
    for tail, entries in batches:
        tail.put(entries)


def _poke(tails: list[Tail]) -> None:
    for tail in tails:
        tail.poke()


class Cursors:
    """The `read` cursors of every open stream, written together: a stream sets its own
    (no Redis call on its path) and one thread writes those that moved every FLUSH_SECONDS,
    in one round trip. A verifier's pause waits on a cursor at most that much older."""

    FLUSH_SECONDS = 0.05

    def __init__(self, store: RequestStore, stopped: threading.Event):
        self.store, self.stopped = store, stopped
        self._moved: dict[str, int] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="read-cursors", daemon=True).start()

    def set(self, rid: str, sent: int) -> None:
        with self._lock:
            self._moved[rid] = max(sent, self._moved.get(rid, 0))

    def _run(self) -> None:
        outage = OutageLog(log, "read cursors")
        while not self.stopped.wait(self.FLUSH_SECONDS):
            with self._lock:
                moved, self._moved = self._moved, {}
            if not moved:
                continue
            try:
                failed = self.store.mark_read_many(moved)
            except REDIS_ERRORS as e:
                outage.failed(e)
                failed = list(moved)
            else:
                outage.succeeded()
            if failed:  # written with the next flush (unless the stream moved on since)
                with self._lock:
                    for rid in failed:
                        self._moved.setdefault(rid, moved[rid])


class Tails:
    """The readers of one gateway (see the module's docstring)."""

    def __init__(self, store: RequestStore, loop: asyncio.AbstractEventLoop):
        self.store, self.loop = store, loop
        self.stopped = threading.Event()
        self.wakes = ThreadPoolExecutor(1, thread_name_prefix="tail-wake")
        self.cursors = Cursors(store, self.stopped)
        self._id = uuid.uuid4().hex[:12]
        self._readers: list[_Reader] = []
        self._lock = threading.Lock()

    def open(self, rid: str, last_id: str = "0-0") -> Tail:
        """Starts reading a request's output after `last_id`. Call from the event loop."""
        tail = Tail(rid, self.store.layout.out(rid), last_id)
        self._reader_for(self.store.layout.shard_of(rid)).add(tail)
        return tail

    def close(self, tail: Tail) -> None:
        if tail.reader is not None:
            tail.reader.remove(tail)

    def open_streams(self) -> int:
        with self._lock:
            return sum(len(r.streams) for r in self._readers)

    def readers(self) -> int:
        with self._lock:
            return len(self._readers)

    def _reader_for(self, shard: int) -> _Reader:
        with self._lock:
            for reader in self._readers:
                if reader.shard == shard and len(reader.streams) < STREAMS_PER_READER:
                    return reader
            n = len(self._readers)
            wake = self.store.layout.gateway_wake(self._id, n, shard)
            reader = _Reader(self, shard, wake)
            self._readers.append(reader)
        threading.Thread(target=reader.run, name=f"tail-{shard}-{n}", daemon=True).start()
        return reader

    def stop(self) -> None:
        self.stopped.set()
