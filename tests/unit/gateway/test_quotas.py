"""A key's tier and quotas as the gateway's calls meet them (quotas.py): what a tier refuses
(`authorize`), the calls a key may have waiting for their request, and its stream slots,
request rate and token rate taken and given back in a private Redis (the real Lua scripts),
each refusal a typed error a client can act on."""

from __future__ import annotations

import asyncio
import contextlib

import httpx2
import openai
import pytest
from prometheus_client import REGISTRY

from specserve.common.settings import DEFAULT_TIERS, Tier
from specserve.gateway.audit import Call
from specserve.gateway.errors import Code, GatewayError
from specserve.gateway.keys import ANONYMOUS, KeyStore, Principal
from specserve.gateway.openai_api import ApiError
from specserve.gateway.quotas import Quotas, authorize
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port
from specserve.v1 import common_pb2, generation_pb2

FREE = Principal("k-free", "acme", "free", DEFAULT_TIERS["free"])  # no batch, max_tokens 512
BATCH = Principal("k-batch", "acme", "batch", DEFAULT_TIERS["batch"])


def request(**fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="hi", **fields)


def refused(who: Principal, req: generation_pb2.GenerateRequest) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        authorize(who, req)
    return err.value


def key(key_id: str, **limits) -> Principal:
    return Principal(key_id, "acme", "custom", Tier(**limits))


def nowhere() -> RequestStore:
    """A store whose Redis is not there (one try, no retries)."""
    return RequestStore.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=0)


def run(quotas_work) -> None:
    asyncio.run(quotas_work())


async def exhausted(take) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        await take
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    return err.value


# --- authorize: what a tier allows -------------------------------------------------------------
def test_a_tier_without_batch_is_refused_the_batch_class_naming_field_and_tier():
    e = refused(FREE, request(priority=common_pb2.PRIORITY_CLASS_BATCH))
    assert e.code == Code.PERMISSION_DENIED
    assert e.message == "priority: this key's tier (free) may not use the batch class"
    assert e.retry_after_ms is None  # (asking again will not help)
    authorize(BATCH, request(priority=common_pb2.PRIORITY_CLASS_BATCH))  # its tier allows it
    authorize(FREE, request(priority=common_pb2.PRIORITY_CLASS_INTERACTIVE))
    authorize(FREE, request())  # (unspecified is interactive)


def test_max_tokens_above_the_tiers_cap_is_refused_with_the_cap_but_max_tokens_unset_is_not():
    e = refused(FREE, request(max_tokens=513))
    assert e.code == Code.PERMISSION_DENIED
    assert e.message == "max_tokens: 513 is above this key's cap of 512"
    authorize(FREE, request(max_tokens=512))  # at the cap
    authorize(FREE, request())  # unset: the gateway's default, within the cap (prepare.py)
    authorize(BATCH, request(max_tokens=513))  # another tier's cap


def test_a_tier_refusal_reaches_an_http_client_as_a_403():
    error = ApiError.of(refused(FREE, request(max_tokens=10_000)))
    assert (error.status, error.type, error.code) == (403, "permission_error", "permission_denied")


def test_without_auth_nothing_is_refused_by_tier():
    authorize(ANONYMOUS, request(priority=common_pb2.PRIORITY_CLASS_BATCH, max_tokens=2**31 - 1))


# --- calls awaiting their request (this gateway's own count) ---------------------------------
def awaiting() -> float:
    return REGISTRY.get_sample_value("specserve_gateway_calls_awaiting_request")


def test_a_key_has_at_most_its_concurrent_streams_of_calls_awaiting_their_request():
    quotas = Quotas(KeyStore(nowhere()), asyncio.to_thread)  # (no Redis: this count is local)
    two, other = key("k-two", concurrent_streams=2), key("k-other", concurrent_streams=2)
    before = awaiting()
    with quotas.awaiting_request(two), quotas.awaiting_request(two):
        assert awaiting() == before + 2
        with pytest.raises(GatewayError) as err, quotas.awaiting_request(two):
            pass
        e = err.value
        assert e.code == Code.RESOURCE_EXHAUSTED and e.retry_after_ms == 1000
        assert "2 calls" in e.message and "cap: 2 concurrent streams" in e.message
        assert "send the request with the headers" in e.message
        with quotas.awaiting_request(other):  # another key's count is its own
            assert awaiting() == before + 3
    assert awaiting() == before
    with quotas.awaiting_request(two), quotas.awaiting_request(two):  # all given back
        pass


def test_a_call_that_fails_while_awaiting_its_request_gives_its_place_back():
    quotas = Quotas(KeyStore(nowhere()), asyncio.to_thread)
    one = key("k-one", concurrent_streams=1)
    with contextlib.suppress(TimeoutError), quotas.awaiting_request(one):
        raise TimeoutError  # (no request within first_message_timeout_seconds)
    with quotas.awaiting_request(one):
        pass


def test_calls_without_auth_await_their_request_without_a_cap():
    quotas = Quotas(KeyStore(nowhere()), asyncio.to_thread)
    with contextlib.ExitStack() as stack:
        for _ in range(100):
            stack.enter_context(quotas.awaiting_request(ANONYMOUS))


# --- stream slots, request and token rates (shared by every gateway, in Redis) ---------------
def test_a_key_opens_at_most_its_concurrent_streams_until_one_is_released(redis_store):
    quotas = Quotas(KeyStore(redis_store), asyncio.to_thread)
    one = key("k-streams", concurrent_streams=1)
    first, second = Call(peer="a", who=one), Call(peer="b", who=one)

    async def work():
        await quotas.open_stream(first, new_request=True)
        assert first.stream  # (its slot, given back at the end)
        e = await exhausted(quotas.open_stream(second, new_request=True))
        assert "1 concurrent streams is used up; retry in 1s" in e.message
        assert e.retry_after_ms == 1000 and not second.stream
        await asyncio.to_thread(quotas.release, first)
        await quotas.open_stream(second, new_request=True)
        assert second.stream and second.stream != first.stream

    run(work)


def test_a_new_request_takes_one_of_its_keys_requests_per_minute_and_a_reattach_none(
    redis_store,
):
    quotas = Quotas(KeyStore(redis_store), asyncio.to_thread)
    one = key("k-rate", requests_per_minute=1)

    async def work():
        await quotas.open_stream(Call(peer="a", who=one), new_request=True)
        e = await exhausted(quotas.open_stream(Call(peer="b", who=one), new_request=True))
        assert "1 requests per minute is used up" in e.message
        assert 50_000 < e.retry_after_ms <= 60_000  # (one request refills in a minute)
        await quotas.open_stream(Call(peer="c", who=one, resumed=True), new_request=False)

    run(work)


def test_a_request_takes_prompt_and_max_tokens_and_gives_back_what_it_did_not_generate(
    redis_store,
):
    quotas = Quotas(KeyStore(redis_store), asyncio.to_thread)
    hundred = key("k-tokens", tokens_per_minute=100)
    first, second = Call(peer="a", who=hundred), Call(peer="b", who=hundred)

    async def work():
        await quotas.open_stream(first, new_request=True)
        await quotas.charge(first, 10, 50)  # 60 taken: 40 left
        assert (first.prompt_tokens, first.max_tokens) == (10, 50)
        await quotas.open_stream(second, new_request=True)
        e = await exhausted(quotas.charge(second, 10, 50))
        assert "100 tokens per minute is used up" in e.message
        assert e.retry_after_ms > 10_000  # (20 tokens at 100 a minute: about 12 s)
        assert (second.prompt_tokens, second.max_tokens) == (0, 0)  # (nothing taken)
        first.emitted = 20
        await asyncio.to_thread(quotas.release, first)  # 30 unused back: 70
        await quotas.charge(second, 10, 50)  # 10 left
        resumed = Call(peer="c", who=hundred, resumed=True, emitted=30)
        await quotas.open_stream(resumed, new_request=False)
        await asyncio.to_thread(quotas.release, resumed)  # (its first call gives back)
        await exhausted(quotas.charge(Call(peer="d", who=hundred), 10, 40))

    run(work)


def test_a_request_larger_than_its_keys_whole_token_rate_is_refused_saying_to_lower_max_tokens(
    redis_store,
):
    quotas = Quotas(KeyStore(redis_store), asyncio.to_thread)
    hundred = key("k-huge", tokens_per_minute=100)

    async def work():
        e = await exhausted(quotas.charge(Call(peer="a", who=hundred), 10, 91))
        assert "needs 101 tokens" in e.message and "lower max_tokens" in e.message
        await quotas.charge(Call(peer="b", who=hundred), 10, 90)  # (it took nothing)

    run(work)


def test_a_request_that_can_never_fit_its_keys_token_rate_is_not_answered_as_one_to_retry(
    redis_store,
):
    quotas = Quotas(KeyStore(redis_store), asyncio.to_thread)
    hundred = key("k-never", tokens_per_minute=100)

    async def refusal() -> GatewayError:
        with pytest.raises(GatewayError) as err:
            await quotas.charge(Call(peer="a", who=hundred), 10, 500)
        return err.value

    error = ApiError.of(asyncio.run(refusal()))
    answer = httpx2.Response(
        error.status,
        headers=error.headers,
        json=error.body(),
        request=httpx2.Request("POST", "http://127.0.0.1:9/v1/completions"),
    )
    client = openai.OpenAI(api_key="none", base_url="http://127.0.0.1:9/v1")
    assert client._should_retry(answer) is False


def test_without_auth_streams_open_and_charge_without_redis():
    quotas = Quotas(KeyStore(nowhere()), asyncio.to_thread)
    call = Call(peer="a")  # (ANONYMOUS)

    async def work():
        await quotas.open_stream(call, new_request=True)
        await quotas.charge(call, 10**6, 10**6)

    run(work)
    assert call.stream and call.max_tokens == 10**6
    quotas.release(call)


def test_quotas_out_of_reach_are_unavailable_to_retry_and_a_release_is_left_to_age_out():
    quotas = Quotas(KeyStore(nowhere()), asyncio.to_thread)
    who = key("k-down")
    call = Call(peer="a", who=who)

    async def work():
        for take in (quotas.open_stream(call, new_request=True), quotas.charge(call, 1, 1)):
            with pytest.raises(GatewayError) as err:
                await take
            assert err.value.code == Code.UNAVAILABLE
            assert err.value.message == "quotas are unavailable; retry shortly"

    run(work)
    assert not call.stream
    call.stream = "1-abc"  # (a slot taken before Redis went away)
    quotas.release(call)  # logged, not raised: the slot ages out in Redis
