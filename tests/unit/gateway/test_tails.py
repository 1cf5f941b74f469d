"""The gateway's output stream tails: a stream cut or its reads failing wakes its reader."""

from __future__ import annotations

import asyncio

from specserve.gateway.tails import Tail, Tails
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port


def test_a_stream_cut_as_its_next_batch_arrives_is_still_cut():
    """A drain cancels the streams it cuts; a batch that arrived in the same loop turn must
    not swallow the cancel (asyncio.wait_for on Python 3.11 does), or the stream runs on."""

    async def cut_as_a_batch_arrives() -> str:
        tail = Tail("r", "out:r", "0-0")
        reading = asyncio.create_task(tail.get())
        await asyncio.sleep(0)  # one loop turn: the task runs until it waits
        assert tail._waiter is not None  # (it is waiting for a batch)
        tail.put([("1-0", {"first": "0", "ids": "7"})])
        reading.cancel()  # (in the same turn: neither has run since)
        try:
            return f"returned {await reading}"
        except asyncio.CancelledError:
            return f"cut, {len(tail.backlog)} batch left"

    assert asyncio.run(cut_as_a_batch_arrives()) == "cut, 1 batch left"


def test_a_waiting_stream_is_woken_when_its_reads_fail():
    """A stream waits on no timer: its reader wakes it when reads fail, for it to see how
    long Redis has been gone (and give up after its limit)."""

    async def wait_with_redis_gone() -> tuple[object, float]:
        # Nothing there; a short retry window (services use about 6 s).
        store = RequestStore.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=3)
        tails = Tails(store, asyncio.get_running_loop())
        try:
            tail = tails.open("r")
            async with asyncio.timeout(30):
                got = await tail.get()
            return got, tail.outage_seconds()
        finally:
            tails.stop()

    got, outage = asyncio.run(wait_with_redis_gone())
    assert got is None and outage > 0
