"""A request's output as the gateway's chunks: read from its Redis output stream (through
`Tails`), detokenized, stop strings trimmed, each token index sent once; the read cursor set
as the client reads; the final entry made the final chunk, or the typed error it ends with.

`Streams` owns which calls on this gateway read which request (so that a request whose
client left is cancelled only when no other call here streams it).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from google.protobuf import json_format

from ..common import logprob_format
from ..v1 import common_pb2, generation_pb2
from . import metrics
from .audit import Call
from .errors import Code, GatewayError
from .tails import Tails
from .text import IncrementalDetokenizer, StopTrimmer

REDIS_OUTAGE_SECONDS = 30.0  # a stream waits this long for Redis before it gives up


class Streams:
    """The output streams of the calls on this gateway. `decode` is the tokenizer's (token
    ids to text, special tokens left out)."""

    def __init__(self, tails: Tails, decode: Callable[[list[int]], str]):
        self.tails = tails
        self.decode = decode
        # open streams by request id (as stored): the calls (by id()) reading each
        self._streaming: dict[str, set[int]] = {}

    def read_by_another(self, call: Call) -> bool:
        """Whether a call other than `call` on this gateway streams its request."""
        return bool(self._streaming.get(call.rid, set()) - {id(call)})

    async def stream(
        self, call: Call, stop: list[str], start: int = 0
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Chunks of the output stream from token index `start` on; the tokens before it only
        prime the detokenizer and the stop trimmer, so the text continues seamlessly. Each
        index is sent once, whatever the stream holds; a Redis outage pauses the stream
        (for up to REDIS_OUTAGE_SECONDS). After each batch of chunks, how far the client has
        been sent goes to the request's `read` cursor: a yield waits while the client does
        not read (gRPC flow control; an HTTP write), so the cursor stops, and the verifier
        pauses the request (`max_unread_tokens`)."""
        reading = _Reading(call, IncrementalDetokenizer(self.decode), StopTrimmer(stop), start)
        rid = call.rid
        call.streaming = True
        metrics.OPEN_STREAMS.inc()
        marked = None  # the cursor as last set
        tail = self.tails.open(rid)
        self._streaming.setdefault(rid, set()).add(id(call))
        try:
            while True:
                if marked != reading.start:
                    self.tails.cursors.set(rid, reading.start)
                    marked = reading.start
                entries = await tail.get()
                if entries is None:  # (woken by its reader's failing reads)
                    if tail.outage_seconds() > REDIS_OUTAGE_SECONDS:
                        call.told_to_reattach = True
                        raise GatewayError(
                            Code.UNAVAILABLE,
                            "request state is unavailable; re-attach with "
                            f"resume_from={reading.start}",
                        )
                    continue
                for entry_id, fields in entries:
                    if (chunk := reading.tokens(entry_id, fields)) is not None:
                        yield chunk
                        reading.sent(chunk)
                    if "final" in fields:
                        yield reading.final(fields)
                        return
        finally:
            self.tails.close(tail)
            readers = self._streaming[rid]
            readers.discard(id(call))
            if not readers:
                del self._streaming[rid]


class _Reading:
    """Where one call's stream stands: the text so far (detokenizer, stop trimmer) and the
    index of the next token to send (`start`)."""

    __slots__ = ("call", "detok", "trimmer", "start", "opened_ms")

    def __init__(self, call: Call, detok: IncrementalDetokenizer, trimmer: StopTrimmer, start):
        self.call, self.detok, self.trimmer, self.start = call, detok, trimmer, start
        self.opened_ms = int(time.time() * 1000)  # entries older than this are a catch-up

    def tokens(
        self, entry_id: str, fields: dict[str, str]
    ) -> generation_pb2.GenerateResponse | None:
        """The chunk of an output stream entry's tokens not sent before (None if none)."""
        ids = [int(t) for t in fields["ids"].split(",")] if fields.get("ids") else []
        lps = fields["lp"].split(";") if "lp" in fields else []
        first = int(fields["first"])
        if skip := max(0, min(len(ids), self.start - first)):  # delivered before
            self.trimmer.push(self.detok.add(ids[:skip]))
            ids, lps, first = ids[skip:], lps[skip:], first + skip
        if not ids:
            return None
        text = self.trimmer.push(self.detok.add(ids))
        committed_ms = int(entry_id.partition("-")[0])
        if committed_ms >= self.opened_ms:  # (not a catch-up)
            metrics.DELIVERY.observe(max(0.0, time.time() - committed_ms / 1000))
        return generation_pb2.GenerateResponse(
            request_id=self.call.public_id,
            text=text,
            token_ids=ids,
            first_index=first,
            model_version=fields.get("v", ""),
            logprobs=map(token_logprob, ids, lps),
        )

    def sent(self, chunk: generation_pb2.GenerateResponse) -> None:
        """A chunk of tokens went out (its yield returned): the next index, and the counts."""
        sent = len(chunk.token_ids)
        self.start = chunk.first_index + sent
        call = self.call
        call.first_token_at = call.first_token_at or time.monotonic()
        call.emitted += sent
        metrics.OUTPUT_TOKENS.inc(sent)

    def final(self, fields: dict[str, str]) -> generation_pb2.GenerateResponse:
        """The final chunk, from the entry that carries the request's end."""
        final = json.loads(fields["final"])
        self.call.finish = final.get("finish_reason", "")
        self.call.pool = final.get("pool", "")
        text = self.trimmer.push(self.detok.flush()) + self.trimmer.flush()
        return final_chunk(self.call.public_id, final, text, int(fields["first"]))


def final_chunk(rid: str, final: dict, text: str, first: int) -> generation_pb2.GenerateResponse:
    """The last chunk, from the output stream's final entry; the typed error of a request
    that ended in one (failed, cancelled, past its deadline)."""
    error = final.pop("error", "")
    if final.get("finish_reason") == "FINISH_REASON_ERROR":
        if error.startswith("grammar: "):  # (the request's grammar ran past its limits)
            raise GatewayError(Code.INVALID_ARGUMENT, error)
        raise GatewayError(Code.INTERNAL, f"generation failed: {error or 'unknown'}")
    if final.get("finish_reason") == "FINISH_REASON_CANCELLED":
        raise GatewayError(Code.CANCELLED, error or "the request was cancelled")
    if final.get("finish_reason") == "FINISH_REASON_DEADLINE":
        raise GatewayError(Code.DEADLINE_EXCEEDED, error or "the deadline passed")
    info = json_format.ParseDict(final, generation_pb2.FinalInfo(), ignore_unknown_fields=True)
    if info.pool:
        metrics.DRAFTED.labels(info.pool).inc(info.speculation.drafted_tokens)
        metrics.ACCEPTED.labels(info.pool).inc(info.speculation.accepted_tokens)
    return generation_pb2.GenerateResponse(
        request_id=rid,
        text=text,
        first_index=first,
        final=info,
        model_version=info.model_version,
    )


def token_logprob(token_id: int, entry: str) -> common_pb2.TokenLogprob:
    """A token's log-probabilities from its output stream entry (common/logprob_format.py)."""
    own, top = logprob_format.decode(entry)
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=own,
        top=[common_pb2.TokenLogprob(token_id=i, logprob=x) for i, x in top],
    )
