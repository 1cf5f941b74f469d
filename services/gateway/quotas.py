"""What a key may ask and how much it may take, as calls see it: its tier's limits, the calls
whose request has not arrived, its open streams' slots and its request and token rates.

The counts shared by every gateway (rates, open streams) are the key store's (keys.py, in
Redis); this module holds this gateway's own part: the calls still waiting for their request,
and the slots of the streams open here (kept alive while they stay open). A quota used up is
a `GatewayError` RESOURCE_EXHAUSTED with when to retry; Redis down, UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

from ..common.outage import REDIS_ERRORS
from ..v1 import common_pb2, generation_pb2
from . import metrics
from .audit import Call
from .errors import Code, GatewayError
from .keys import STREAM_TOUCH_SECONDS, KeyStore, Principal, QuotaExceeded, stream_id

log = logging.getLogger(__name__)


def authorize(who: Principal, request: generation_pb2.GenerateRequest) -> None:
    """PERMISSION_DENIED for what the key's tier does not allow (read from the request as
    sent: a max_tokens left unset is within the cap)."""
    limits = who.limits
    if limits is None:
        return
    if request.priority == common_pb2.PRIORITY_CLASS_BATCH and not limits.batch:
        raise GatewayError(
            Code.PERMISSION_DENIED,
            f"priority: this key's tier ({who.tier}) may not use the batch class",
        )
    if request.max_tokens > limits.max_tokens:
        raise GatewayError(
            Code.PERMISSION_DENIED,
            f"max_tokens: {request.max_tokens} is above this key's cap of {limits.max_tokens}",
        )


class Quotas:
    """A gateway's quotas. `io` runs blocking work (the key store's Redis calls) off the
    event loop."""

    def __init__(self, keys: KeyStore, io: Callable[..., Awaitable]):
        self.keys = keys
        self._io = io
        self._slots: dict[str, str] = {}  # open streams' quota slots: stream id -> key id
        self._awaiting: dict[str, int] = {}  # calls whose request has not arrived, by key id

    @contextlib.contextmanager
    def awaiting_request(self, who: Principal) -> Iterator[None]:
        """Counts a call, authenticated from its headers, while its request message (or HTTP
        body) is on its way: a key has at most its `concurrent_streams` of those on this
        gateway (RESOURCE_EXHAUSTED past that), so headers sent without a request hold at
        most a key's own share of the server's calls, for at most
        first_message_timeout_seconds."""
        limit = who.limits.concurrent_streams if who.limits is not None else None
        waiting = self._awaiting.get(who.key_id, 0)
        if limit is not None and waiting >= limit:
            raise GatewayError(
                Code.RESOURCE_EXHAUSTED,
                f"this key has {waiting} calls on this gateway whose request has not arrived "
                f"(its cap: {limit} concurrent streams); send the request with the headers",
                retry_after_ms=1000,
            )
        self._awaiting[who.key_id] = waiting + 1
        metrics.AWAITING_REQUEST.inc()
        try:
            yield
        finally:
            metrics.AWAITING_REQUEST.dec()
            if (left := self._awaiting.pop(who.key_id) - 1) > 0:
                self._awaiting[who.key_id] = left

    async def open_stream(self, call: Call, new_request: bool) -> None:
        """Takes a stream slot (and, for a new request, one request of its rate)."""
        sid = stream_id()
        await self._take(self.keys.admit, call.who, sid, new_request=new_request)
        call.stream = sid
        if call.who.limits is not None:
            self._slots[sid] = call.who.key_id

    async def charge(self, call: Call, prompt_tokens: int, max_tokens: int) -> None:
        """Takes a new request's tokens (prompt + max_tokens) from its key's rate; what it
        does not generate goes back when it ends."""
        await self._take(self.keys.take_tokens, call.who, prompt_tokens + max_tokens)
        call.prompt_tokens, call.max_tokens = prompt_tokens, max_tokens

    async def _take(self, take, *args, **kwargs) -> None:
        """A quota's `take`, off the loop: RESOURCE_EXHAUSTED, with when to retry if used up, or
        as not to be retried if the request could never pass (it asks for more than a minute's
        tokens)."""
        try:
            await self._io(take, *args, **kwargs)
        except QuotaExceeded as e:
            retry = e.retry_after_ms is not None
            raise GatewayError(
                Code.RESOURCE_EXHAUSTED, str(e), e.retry_after_ms, retryable=retry
            ) from None
        except REDIS_ERRORS:
            raise GatewayError(Code.UNAVAILABLE, "quotas are unavailable; retry shortly") from None

    def stream_closed(self, call: Call) -> None:
        """The call's stream is over (on the loop): its slot is no longer kept alive."""
        self._slots.pop(call.stream, None)

    def release(self, call: Call) -> None:
        """Gives back the call's stream slot and the tokens it took but did not generate
        (blocking: on a thread)."""
        if call.stream:
            unused = 0 if call.resumed else call.max_tokens - call.emitted
            try:
                self.keys.release(call.who, call.stream, unused)
            except REDIS_ERRORS:
                log.warning("quota release failed; the slot ages out")

    async def keep_slots_alive(self) -> None:
        """Marks every open stream's quota slot alive every STREAM_TOUCH_SECONDS, so that a
        stream open for longer than STREAM_MAX_AGE_MS (long reasoning) still counts against
        its key's cap; a slot of a gateway that died still ages out."""
        while True:
            await asyncio.sleep(STREAM_TOUCH_SECONDS)
            try:
                await self._io(self.keys.touch, [(k, s) for s, k in self._slots.items()])
            except REDIS_ERRORS:
                log.warning("stream slots not refreshed; tried again next time")
