"""A request's output as the gateway's chunks (streaming.py): the final chunk made of the
output stream's final entry, or the typed error a request ended with (`final_chunk`); a
token's log-probabilities; and `Streams.stream` reading a private Redis written by the store's
own step and finish writes (each index sent once, a re-attach's text continuing seamlessly,
who else reads a request)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading

import pytest
from prometheus_client import REGISTRY

from specserve.gateway.audit import Call
from specserve.gateway.errors import Code, GatewayError
from specserve.gateway.openai_api import ApiError
from specserve.gateway.streaming import Streams, final_chunk, token_logprob
from specserve.gateway.tails import Tails
from specserve.store import RequestStore
from specserve.v1 import common_pb2, generation_pb2


def final(**fields) -> dict:
    """A final entry's JSON as a verifier writes it (verifier/sequence.py, writes.py)."""
    return {
        "finish_reason": "FINISH_REASON_EOS",
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "cached_prompt_tokens": 0},
        "timings": {"queue_ms": 1.5, "prefill_ms": 2.0, "decode_ms": 10.0, "ttft_ms": 4.0},
        "speculation": {"drafted_tokens": 8, "accepted_tokens": 6, "steps": 3},
        "error": "",
        "pool": "stable",
        "model_version": "m@v1",
    } | fields


def ended(entry: dict) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        final_chunk("r1", entry, "", 5)
    return err.value


# --- final_chunk -------------------------------------------------------------------------------
def test_a_final_entry_becomes_the_last_chunk_with_its_text_and_what_the_request_used():
    chunk = final_chunk("r1", final(), "!", 5)
    assert (chunk.request_id, chunk.text, chunk.first_index) == ("r1", "!", 5)
    assert not chunk.token_ids and chunk.model_version == "m@v1"
    info = chunk.final
    assert info.finish_reason == common_pb2.FINISH_REASON_EOS
    assert (info.usage.prompt_tokens, info.usage.completion_tokens) == (3, 5)
    assert info.timings.ttft_ms == 4.0 and info.speculation.accepted_tokens == 6
    assert (info.pool, info.model_version, info.cached) == ("stable", "m@v1", False)


def test_a_final_entry_with_fields_this_gateway_does_not_know_still_ends_the_stream():
    """A newer verifier may write more (a rolling upgrade): what is not known is left out."""
    chunk = final_chunk("r1", final(new_field={"x": 1}), "", 5)
    assert chunk.final.finish_reason == common_pb2.FINISH_REASON_EOS


def test_a_queued_requests_short_final_entry_ends_the_stream():
    """The scheduler's final entry of a request that ended while queued carries only its
    reason and usage (scheduler/server.py ended_final)."""
    entry = {"finish_reason": "FINISH_REASON_LENGTH", "usage": {"prompt_tokens": 2}, "error": ""}
    info = final_chunk("r1", entry, "", 0).final
    assert info.finish_reason == common_pb2.FINISH_REASON_LENGTH and info.usage.prompt_tokens == 2


@pytest.mark.parametrize(
    "reason,error,code,message",
    [
        ("FINISH_REASON_ERROR", "CUDA out of memory", Code.INTERNAL, "generation failed: CUDA "),
        ("FINISH_REASON_ERROR", "", Code.INTERNAL, "generation failed: unknown"),
        ("FINISH_REASON_CANCELLED", "", Code.CANCELLED, "the request was cancelled"),
        ("FINISH_REASON_CANCELLED", "by its owner", Code.CANCELLED, "by its owner"),
        ("FINISH_REASON_DEADLINE", "", Code.DEADLINE_EXCEEDED, "the deadline passed"),
        (
            "FINISH_REASON_DEADLINE",
            "the deadline passed while it ran",
            Code.DEADLINE_EXCEEDED,
            "the deadline passed while it ran",
        ),
    ],
)
def test_a_request_that_ended_in_failure_ends_its_stream_with_the_typed_error(
    reason, error, code, message
):
    e = ended(final(finish_reason=reason, error=error))
    assert e.code == code and e.message.startswith(message)
    assert e.retry_after_ms is None


def test_a_grammar_that_ran_past_its_limits_is_the_requests_fault_naming_its_field():
    e = ended(final(finish_reason="FINISH_REASON_ERROR", error="grammar: too many steps"))
    assert (e.code, e.message) == (Code.INVALID_ARGUMENT, "grammar: too many steps")
    assert ApiError.of(e).param == "response_format"  # (as an HTTP client named it)


def test_an_error_beside_a_finish_that_is_not_a_failure_is_not_raised():
    chunk = final_chunk("r1", final(finish_reason="FINISH_REASON_STOP", error="late"), "", 5)
    assert chunk.final.finish_reason == common_pb2.FINISH_REASON_STOP


def counted(name: str, pool: str) -> float:
    return REGISTRY.get_sample_value(name, {"pool": pool}) or 0.0


def test_a_finished_requests_drafts_are_counted_for_its_pool_and_not_without_one():
    pool = "test-streaming-pool"
    drafted = counted("specserve_gateway_drafted_tokens_total", pool)
    accepted = counted("specserve_gateway_accepted_tokens_total", pool)
    final_chunk("r1", final(pool=pool), "", 5)
    assert counted("specserve_gateway_drafted_tokens_total", pool) == drafted + 8
    assert counted("specserve_gateway_accepted_tokens_total", pool) == accepted + 6
    final_chunk("r1", final(pool=""), "", 5)  # (replayed or ended queued: no pool ran it)
    assert counted("specserve_gateway_drafted_tokens_total", pool) == drafted + 8


# --- log-probabilities -------------------------------------------------------------------------
def test_a_tokens_log_probabilities_come_with_the_top_tokens_most_likely_first():
    lp = token_logprob(7, "-0.25 7:-0.25 9:-1.5")
    assert (lp.token_id, lp.logprob) == (7, -0.25)
    assert [(t.token_id, t.logprob) for t in lp.top] == [(7, -0.25), (9, -1.5)]
    assert not any(t.top for t in lp.top)
    assert list(token_logprob(3, "-2").top) == []


def test_a_token_whose_log_probability_is_unknown_has_nan_and_no_top():
    lp = token_logprob(7, "-")
    assert lp.token_id == 7 and math.isnan(lp.logprob) and not lp.top


# --- Streams.stream on a private Redis ---------------------------------------------------------
def decode(ids: list[int]) -> str:
    """Byte-level ids (a character may take several), as a tokenizer decodes them."""
    return bytes(ids).decode("utf-8", errors="replace")


TEXT = "Olé, ok".encode()  # "é" is two ids: a chunk may end inside it


def generated(store: RequestStore, rid: str, steps: list[list[int]], **end) -> None:
    """A request run on verifier v1 through the store's writes: its steps' tokens (with
    log-probabilities), then its end."""
    assert store.create(rid, {"prompt_ids": [1, 2, 3], "max_tokens": 50}, "interactive", 10)[0] == 0
    assert store.claim(rid, "v1", 0, version="m@v1", pool="stable")
    first = 0
    for ids in steps:
        lps = [f"-0.5 {i}:-0.5" for i in ids]
        store.commit_step("v1", [(rid, first, ids, lps)], version="m@v1")
        first += len(ids)
    entry = final(usage={"prompt_tokens": 3, "completion_tokens": first}) | end
    assert store.finish(rid, "v1", "finished", entry, "interactive")


def stopped(tails: Tails) -> None:
    """Stops the tails' reader threads and waits for them to end (each is woken from its
    blocked read), so none outlives the test's event loop and Redis."""
    tails.stop()
    for reader in tails._readers:
        reader._wake()
    tails.wakes.shutdown()
    for thread in threading.enumerate():
        if re.fullmatch(r"tail-\d+-\d+", thread.name):  # (a reader: tails.py)
            thread.join(timeout=5)


def read(store: RequestStore, call: Call, stop: list[str], start: int = 0) -> list:
    """The chunks of `call`'s stream, to its end (or the error it ends with, last)."""

    async def stream() -> list:
        tails = Tails(store, asyncio.get_running_loop())
        chunks = []
        try:
            async with asyncio.timeout(10):
                async for chunk in Streams(tails, decode).stream(call, stop, start):
                    chunks.append(chunk)
        except GatewayError as e:
            chunks.append(e)
        finally:
            stopped(tails)
        return chunks

    return asyncio.run(stream())


def test_a_stream_sends_each_token_once_with_its_text_then_its_end(redis_store):
    generated(redis_store, "acme:r1", [list(TEXT[:3]), list(TEXT[3:6]), list(TEXT[6:])])
    call = Call(peer="a", public_id="r1", rid="acme:r1")
    *tokens, end = read(redis_store, call, [])
    assert [c.first_index for c in tokens] == [0, 3, 6]
    assert [i for c in tokens for i in c.token_ids] == list(TEXT)
    assert "".join(c.text for c in tokens) + end.text == "Olé, ok"
    assert [c.text for c in tokens[:2]] == ["", "Olé, "]  # (a delta ending inside "é" waits)
    assert all(c.request_id == "r1" and c.model_version == "m@v1" for c in tokens + [end])
    assert [len(c.logprobs) for c in tokens] == [len(c.token_ids) for c in tokens]
    assert tokens[1].logprobs[0].token_id == TEXT[3] and tokens[1].logprobs[0].logprob == -0.5
    assert end.final.finish_reason == common_pb2.FINISH_REASON_EOS
    assert end.first_index == len(TEXT) and not end.token_ids
    assert (call.emitted, call.finish, call.pool) == (len(TEXT), "FINISH_REASON_EOS", "stable")
    assert call.streaming and call.first_token_at > 0


def test_a_reattached_stream_sends_the_tokens_from_its_index_and_its_text_goes_on(redis_store):
    generated(redis_store, "acme:r1", [list(TEXT[:3]), list(TEXT[3:6]), list(TEXT[6:])])
    call = Call(peer="a", public_id="r1", rid="acme:r1", resumed=True)
    *tokens, end = read(redis_store, call, [], start=4)  # (mid-step, and after half an "é")
    assert tokens[0].first_index == 4
    assert [i for c in tokens for i in c.token_ids] == list(TEXT[4:])
    assert "".join(c.text for c in tokens) + end.text == TEXT[4:].decode()
    assert call.emitted == len(TEXT) - 4


def test_a_stream_holding_an_index_twice_sends_it_once(redis_store):
    """After a Redis that lost writes, a verifier resends from what it holds: entries may
    overlap; the client still gets each index once, in order."""
    out = redis_store.layout.out("acme:r1")
    for first, ids in ((0, TEXT[:4]), (2, TEXT[2:6]), (5, TEXT[5:])):
        redis_store.r.xadd(out, {"first": first, "ids": ",".join(map(str, ids)), "v": "m@v1"})
    redis_store.r.xadd(out, {"first": len(TEXT), "ids": "", "final": json.dumps(final())})
    *tokens, end = read(redis_store, Call(peer="a", public_id="r1", rid="acme:r1"), [])
    assert [(c.first_index, bytes(c.token_ids)) for c in tokens] == [
        (0, TEXT[:4]),
        (4, TEXT[4:6]),
        (6, TEXT[6:]),
    ]
    assert "".join(c.text for c in tokens) + end.text == "Olé, ok"
    assert not tokens[0].logprobs  # (none asked: none sent)


def test_a_stream_cuts_its_text_at_a_stop_string(redis_store):
    generated(redis_store, "acme:r1", [list(TEXT[:3]), list(TEXT[3:])])
    *tokens, end = read(redis_store, Call(peer="a", public_id="r1", rid="acme:r1"), [", "])
    assert "".join(c.text for c in tokens) + end.text == "Olé"


def test_a_request_that_failed_ends_its_stream_after_its_tokens_with_the_error(redis_store):
    generated(
        redis_store,
        "acme:r1",
        [list(TEXT[:3])],
        finish_reason="FINISH_REASON_ERROR",
        error="the step broke",
    )
    call = Call(peer="a", public_id="r1", rid="acme:r1")
    tokens, error = read(redis_store, call, [])
    assert list(tokens.token_ids) == list(TEXT[:3])
    assert (error.code, error.message) == (Code.INTERNAL, "generation failed: the step broke")
    assert call.finish == "FINISH_REASON_ERROR"  # (it ended: nothing is left to cancel)


def test_a_request_is_read_by_another_call_only_while_that_call_streams_it(redis_store):
    """Whether a client that left may have its request cancelled (calls.py): not while another
    call on this gateway (a retry that re-attached) still streams it."""
    generated(redis_store, "acme:r1", [list(TEXT[:3]), list(TEXT[3:])])
    reader = Call(peer="a", public_id="r1", rid="acme:r1")
    left = Call(peer="b", public_id="r1", rid="acme:r1")
    elsewhere = Call(peer="c", public_id="r2", rid="acme:r2")

    async def work() -> list[bool]:
        tails = Tails(redis_store, asyncio.get_running_loop())
        streams = Streams(tails, decode)
        try:
            stream = streams.stream(reader, [])
            async with asyncio.timeout(10):
                await anext(stream)  # (open, mid-stream)
                seen = [
                    streams.read_by_another(left),
                    streams.read_by_another(reader),
                    streams.read_by_another(elsewhere),
                ]
                async for _ in stream:
                    pass
            return [*seen, streams.read_by_another(left)]
        finally:
            stopped(tails)

    assert asyncio.run(work()) == [True, False, False, False]


def test_a_chunk_is_a_generate_response_the_wire_carries():
    """(The chunks are the service contract's messages: they serialize as they are.)"""
    chunk = final_chunk("r1", final(), "x", 5)
    again = generation_pb2.GenerateResponse.FromString(chunk.SerializeToString())
    assert again == chunk
