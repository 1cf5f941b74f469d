"""The result cache (result_cache.py): which requests may be replayed (deterministic ones
only), the key that names a result (everything that changes the output, nothing else), the
model versions that would serve a request now, and a result cached from its stream, looked up
and replayed in a private Redis."""

from __future__ import annotations

import asyncio
import re

import pytest

from specserve.common.pools import bucket
from specserve.gateway.audit import Call
from specserve.gateway.result_cache import (
    ResultCache,
    replayable,
    result_cache_key,
    serving_versions,
)
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port
from specserve.v1 import common_pb2, generation_pb2, scheduler_pb2


def submit(**fields) -> scheduler_pb2.SubmitRequest:
    """A greedy request as the gateway submits it; `fields` replace its own."""
    base = dict(
        request_id="acme:r1",
        prompt_ids=[1, 2, 3],
        max_tokens=16,
        stop=["\n"],
        priority=common_pb2.PRIORITY_CLASS_INTERACTIVE,
        tenant="acme",
        prefix_scope="acme",
    )
    return scheduler_pb2.SubmitRequest(**(base | fields))


def greedy(**sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, **sampling)


def seeded(**sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**({"temperature": 0.7, "seed": 7} | sampling))


def out_of_reach() -> RequestStore:
    """A store whose Redis is not there (one try, no retries)."""
    return RequestStore.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=0)


def decode(ids: list[int]) -> str:
    """Byte-level ids (a character may take several), as a tokenizer decodes them."""
    return bytes(ids).decode("utf-8", errors="replace")


# --- which requests are deterministic ----------------------------------------------------------
@pytest.mark.parametrize(
    "sampling,logprobs,answer",
    [
        (greedy(), False, True),
        (greedy(top_k=5, top_p=0.5), False, True),
        (seeded(), False, True),
        (seeded(seed=0), False, True),  # (0 is a seed like any other)
        (common_pb2.SamplingParams(temperature=0.7), False, False),  # unseeded sampling
        (common_pb2.SamplingParams(temperature=2.0, top_k=1), False, False),
        (greedy(), True, False),  # (the cache keeps token ids alone)
        (seeded(), True, False),
    ],
)
def test_only_greedy_or_seeded_requests_without_logprobs_are_replayable(sampling, logprobs, answer):
    assert replayable(submit(sampling=sampling, logprobs=logprobs)) is answer


# --- the key -----------------------------------------------------------------------------------
def test_a_key_is_a_sha256_of_equal_requests_alike():
    key = result_cache_key(submit(), "m@v1")
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert result_cache_key(submit(), "m@v1") == key  # (built afresh: the same)


@pytest.mark.parametrize(
    "changed",
    [
        {"prompt_ids": [1, 2, 4]},
        {"prompt_ids": [3, 2, 1]},
        {"prompt_ids": [1, 2, 3, 3]},
        {"max_tokens": 17},
        {"stop": ["\n", "END"]},
        {"stop": ["END"]},
        {"stop": []},
        {"grammar": common_pb2.Grammar(regex="[a-z]+")},
        {"grammar": common_pb2.Grammar(json_schema='{"type": "object"}')},
        {"prefix_scope": "globex"},  # (another tenant's, under prefix_cache_scope: tenant)
        {"prefix_scope": ""},  # (anyone's, under prefix_cache_scope: global)
    ],
    ids=lambda changed: ",".join(f"{k}={v!r}".replace("\n", "\\n") for k, v in changed.items()),
)
def test_a_key_changes_with_what_changes_a_greedy_output(changed):
    assert result_cache_key(submit(**changed), "m@v1") != result_cache_key(submit(), "m@v1")


def test_a_key_changes_with_the_model_version_that_made_the_result():
    assert result_cache_key(submit(), "m@v1") != result_cache_key(submit(), "m@v2")
    assert result_cache_key(submit(), "m@v1") != result_cache_key(submit(), "")


@pytest.mark.parametrize(
    "unchanged",
    [
        {"request_id": "acme:another"},
        {"priority": common_pb2.PRIORITY_CLASS_BATCH},
        {"deadline_unix_ms": 1_900_000_000_000},
        {"session_id": "acme:s1"},
        {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
        {"tenant": "globex"},  # (its prefix scope, not its name, keeps tenants apart)
        {"pool": "canary"},  # (the model version says what served it)
        {"sampling": greedy(top_k=5, top_p=0.5, seed=3)},  # (greedy ignores them)
        {"speculation": common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF)},
        {"speculation": common_pb2.SpeculationOptions(tree_size=16)},
    ],
    ids=lambda unchanged: ",".join(unchanged),
)
def test_a_greedy_key_is_the_same_whatever_does_not_change_its_output(unchanged):
    assert result_cache_key(submit(**unchanged), "m@v1") == result_cache_key(submit(), "m@v1")


@pytest.mark.parametrize(
    "changed",
    [
        {"sampling": seeded(seed=8)},
        {"sampling": seeded(temperature=0.8)},
        {"sampling": seeded(top_p=0.9)},
        {"sampling": seeded(top_k=40)},
        {"speculation": common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF)},
        {"speculation": common_pb2.SpeculationOptions(tree_size=16)},
        {"prompt_ids": [1, 2, 4]},
        {"max_tokens": 17},
        {"stop": ["END"]},
    ],
    ids=lambda changed: ",".join(f"{k}={v}".replace("\n", " ") for k, v in changed.items()),
)
def test_a_seeded_key_also_changes_with_its_sampling_and_speculation_options(changed):
    """A seeded draw depends on the trees speculation drafts, so they are part of its key."""
    base = submit(sampling=seeded())
    other = submit(**({"sampling": seeded()} | changed))
    assert result_cache_key(other, "m@v1") != result_cache_key(base, "m@v1")


def test_a_seeded_key_is_the_same_whatever_else_does_not_change_its_output():
    base = submit(sampling=seeded())
    for unchanged in (
        {"request_id": "acme:x"},
        {"priority": common_pb2.PRIORITY_CLASS_BATCH},
        {"deadline_unix_ms": 5},
        {"session_id": "acme:s"},
    ):
        same = submit(**({"sampling": seeded()} | unchanged))
        assert result_cache_key(same, "m@v1") == result_cache_key(base, "m@v1"), unchanged


def test_a_seeded_result_never_answers_the_greedy_request_of_the_same_prompt():
    assert result_cache_key(submit(sampling=seeded()), "m@v1") != result_cache_key(submit(), "m@v1")


# --- the versions that would serve a request now ---------------------------------------------
STABLE = [{"id": "v1", "pool": "stable", "version": "m@1"}]
CANARY = [{"id": "v2", "pool": "canary", "version": "m@2"}]


def ids_in(low: float, high: float) -> list[str]:
    """Request ids whose canary bucket falls in [low, high)."""
    return [rid for rid in (f"r{i}" for i in range(200)) if low <= bucket(rid) < high][:5]


def test_with_no_live_verifier_no_version_would_serve_a_request():
    assert serving_versions([], 0.0, "r") == [] and serving_versions([], 1.0, "r") == []


def test_the_stable_pools_versions_serve_every_request_without_a_canary_share():
    both = STABLE + CANARY
    assert all(serving_versions(both, 0.0, rid) == ["m@1"] for rid in ids_in(0, 1))
    assert serving_versions([{"id": "v0", "version": "m@1"}], 0.0, "r") == ["m@1"]  # (no pool)


def test_a_pool_mid_upgrade_serves_both_of_its_versions():
    upgrading = STABLE + [{"id": "v3", "pool": "stable", "version": "m@0"}]
    assert serving_versions(upgrading, 0.0, "r") == ["m@0", "m@1"]


def test_the_canary_share_sends_a_request_to_its_pools_versions_by_its_id():
    both = STABLE + CANARY
    canaried, stayed = ids_in(0, 0.5), ids_in(0.5, 1)
    assert canaried and stayed
    assert all(serving_versions(both, 0.5, rid) == ["m@2"] for rid in canaried)
    assert all(serving_versions(both, 0.5, rid) == ["m@1"] for rid in stayed)
    assert all(serving_versions(both, 1.0, rid) == ["m@2"] for rid in stayed)


def test_a_canary_that_is_down_passes_its_share_but_a_promoted_one_is_waited_for():
    assert all(serving_versions(STABLE, 0.5, rid) == ["m@1"] for rid in ids_in(0, 0.5))
    assert serving_versions(STABLE, 1.0, "r") == []  # (requests wait for the canary)


# --- cached from a stream, looked up, replayed (a private Redis) -----------------------------
def live(store: RequestStore, version: str, pool: str = "stable", vid: str = "v1") -> None:
    store.heartbeat(vid, {"pool": pool, "version": version}, ttl_seconds=60)


def stream_of(text: bytes, version: str) -> list[generation_pb2.GenerateResponse]:
    """A request's chunks as the gateway streams them: its tokens in two chunks, then its end."""
    ids, half = list(text), len(text) // 2
    final = generation_pb2.FinalInfo(
        finish_reason=common_pb2.FINISH_REASON_LENGTH, model_version=version, pool="stable"
    )
    final.usage.prompt_tokens, final.usage.completion_tokens = 3, len(ids)
    final.timings.queue_ms, final.timings.decode_ms = 5.0, 40.0
    final.speculation.steps = 4
    return [
        generation_pb2.GenerateResponse(
            request_id="r1", text=decode(ids[:half]), token_ids=ids[:half], model_version=version
        ),
        generation_pb2.GenerateResponse(
            request_id="r1",
            text=decode(ids[half:]),
            token_ids=ids[half:],
            first_index=half,
            model_version=version,
        ),
        generation_pb2.GenerateResponse(request_id="r1", first_index=len(ids), final=final),
    ]


async def chunks_of(chunks):
    for chunk in chunks:
        yield chunk


async def cache_through(cache: ResultCache, req, chunks) -> list:
    return [c async for c in cache.caching(chunks_of(chunks), req)]


def test_a_streamed_result_is_cached_and_replayed_as_a_stream_of_its_tokens_then_its_end(
    redis_store,
):
    cache = ResultCache(redis_store, 60, decode, asyncio.to_thread)
    live(redis_store, "m@v1")
    req = submit(stop=[])
    streamed = stream_of("déjà vu".encode(), "m@v1")
    call = Call(peer="a", public_id="mine")

    async def work():
        assert await cache.lookup(req) is None  # (nothing cached yet)
        passed = await cache_through(cache, req, streamed)
        hit = await cache.lookup(req)
        assert hit is not None
        return passed, hit, [c async for c in cache.replay(call, *hit, [])]

    passed, (ids, final), replayed = asyncio.run(work())
    assert passed == streamed  # (the stream goes on as it was)
    assert ids == list("déjà vu".encode())
    assert final["model_version"] == "m@v1"
    tokens, end = replayed
    assert tokens.request_id == end.request_id == "mine"  # (the replaying call's own id)
    assert list(tokens.token_ids) == ids and tokens.first_index == 0
    assert tokens.text + end.text == "déjà vu" and tokens.model_version == "m@v1"
    assert end.first_index == len(ids) and not end.token_ids
    assert end.final.cached and end.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert end.final.timings == common_pb2.Timings()  # (nothing ran)
    assert end.final.usage.completion_tokens == len(ids) and end.final.speculation.steps == 4
    assert (call.emitted, call.finish) == (len(ids), "FINISH_REASON_LENGTH")


def test_a_replay_cuts_the_text_at_the_requests_stop_string():
    cache = ResultCache(out_of_reach(), 60, decode, asyncio.to_thread)  # (a replay reads none)
    ids = list(b"Hello. World")

    async def replay() -> list:
        return [c async for c in cache.replay(Call(peer="a"), ids, {"finish_reason": 3}, ["."])]

    tokens, end = asyncio.run(replay())
    assert tokens.text + end.text == "Hello"
    assert list(tokens.token_ids) == ids  # (the tokens are the request's, as streamed)
    assert end.final.finish_reason == common_pb2.FINISH_REASON_STOP


def test_a_cached_result_is_replayed_only_where_its_version_would_serve_the_request_now(
    redis_store,
):
    cache = ResultCache(redis_store, 60, decode, asyncio.to_thread)
    req = submit(request_id=ids_in(0, 0.5)[0])  # (one the canary gets at a share of 0.5)
    live(redis_store, "m@v1")

    async def lookup():
        return await cache.lookup(req)

    asyncio.run(cache_through(cache, req, stream_of(b"ok", "m@v1")))
    assert asyncio.run(lookup()) is not None
    live(redis_store, "m@v2", pool="canary", vid="v2")
    redis_store.set_canary_share(0.5)
    assert asyncio.run(lookup()) is None  # the canary, another version, would serve it
    redis_store.set_canary_share(0.0)
    assert asyncio.run(lookup()) is not None
    redis_store.deregister("v1")
    live(redis_store, "m@v3", vid="v3")  # the stable pool upgraded
    assert asyncio.run(lookup()) is None


def test_a_result_is_not_cached_without_the_version_that_made_it_or_without_an_end(
    redis_store,
):
    cache = ResultCache(redis_store, 60, decode, asyncio.to_thread)
    live(redis_store, "")  # (a lookup that would find one under the empty version)
    req = submit()
    unversioned = stream_of(b"ok", "")
    asyncio.run(cache_through(cache, req, unversioned))
    asyncio.run(cache_through(cache, req, stream_of(b"ok", "m@v1")[:2]))  # (cut before its end)
    live(redis_store, "m@v1", vid="v2")

    async def lookup():
        return await cache.lookup(req)

    assert asyncio.run(lookup()) is None


def test_a_seeded_result_is_not_replayed_for_another_seed(redis_store):
    cache = ResultCache(redis_store, 60, decode, asyncio.to_thread)
    live(redis_store, "m@v1")
    asyncio.run(cache_through(cache, submit(sampling=seeded()), stream_of(b"ok", "m@v1")))

    async def lookup(sampling):
        return await cache.lookup(submit(sampling=sampling))

    assert asyncio.run(lookup(seeded())) is not None
    assert asyncio.run(lookup(seeded(seed=8))) is None


def test_with_redis_out_of_reach_a_lookup_misses_and_a_stream_goes_on_uncached():
    cache = ResultCache(out_of_reach(), 60, decode, asyncio.to_thread)
    streamed = stream_of(b"ok", "m@v1")

    async def work():
        return await cache.lookup(submit()), await cache_through(cache, submit(), streamed)

    missed, passed = asyncio.run(work())
    assert missed is None and passed == streamed
