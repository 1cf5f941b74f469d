"""A client's GenerateRequest made into the scheduler's SubmitRequest (prepare.py), with the
default target's real tokenizer and chat template, real llguidance grammars and real gateway
settings: the client's options carried, the gateway's defaults within a key's tier, ids and
scopes of its tenant, and each refusal naming its field (a grammar that does not compile, a
request no verifier's KV budget holds, registered in a private Redis). One preparer serves the
tests that compile grammars (its grammars' tokenizer takes a second to build)."""

from __future__ import annotations

import json
import time

import pytest

from specserve.common.settings import DEFAULT_TIERS, GatewaySettings, Tier
from specserve.gateway.keys import ANONYMOUS, Principal
from specserve.gateway.prepare import Preparer
from specserve.gateway.validation import InvalidRequest, Limits
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port
from specserve.v1 import common_pb2, generation_pb2

ACME = Principal("k1", "acme", "standard", DEFAULT_TIERS["standard"])  # max_tokens 8192
FREE = Principal("k2", "acme", "free", DEFAULT_TIERS["free"])  # max_tokens 512


def preparer(tokenizer, store: RequestStore, max_seq_len: int = 2048, **settings) -> Preparer:
    config = GatewaySettings(max_seq_len=max_seq_len, max_tokens_limit=1024, **settings)
    limits = Limits(
        vocab_size=len(tokenizer),
        max_seq_len=config.max_seq_len,
        max_tokens_limit=config.max_tokens_limit,
        max_stop_strings=config.max_stop_strings,
        max_stop_length=config.max_stop_length,
    )
    return Preparer(config, tokenizer, limits, store)


def out_of_reach() -> RequestStore:
    """A store whose Redis is not there: no registry to read (one try, no retries)."""
    return RequestStore.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=0)


@pytest.fixture(scope="module")
def prep(tokenizer) -> Preparer:
    """Default settings; the registry out of reach (sizes are then left to the scheduler)."""
    return preparer(tokenizer, out_of_reach())


def refused(prep: Preparer, req, who: Principal = ACME) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        prep.submit_request(req, None, who)
    return err.value


def test_a_text_prompt_is_tokenized_and_the_clients_options_are_carried(tokenizer, prep):
    req = generation_pb2.GenerateRequest(
        request_id="r-1",
        prompt="Hello, world",
        max_tokens=7,
        sampling=common_pb2.SamplingParams(temperature=0.5, top_k=4, seed=3),
        stop=["\n", "END"],
        priority=common_pb2.PRIORITY_CLASS_BATCH,
        speculation=common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF),
        logprobs=True,
        top_logprobs=2,
        grammar=common_pb2.Grammar(regex="[a-z]+"),
    )
    submit = prep.submit_request(req, None, ACME)
    assert list(submit.prompt_ids) == tokenizer("Hello, world").input_ids
    assert submit.request_id == "r-1"  # (the core scopes it to the tenant)
    assert submit.max_tokens == 7 and list(submit.stop) == ["\n", "END"]
    assert submit.sampling == req.sampling and submit.speculation == req.speculation
    assert submit.priority == common_pb2.PRIORITY_CLASS_BATCH
    assert (submit.logprobs, submit.top_logprobs) == (True, 2)
    assert submit.grammar.regex == "[a-z]+"
    assert submit.tenant == "acme" and submit.deadline_unix_ms == 0  # (no deadline)


def test_a_request_without_an_id_or_a_class_gets_a_fresh_id_and_the_interactive_class(
    tokenizer, prep
):
    ids = {
        prep.submit_request(generation_pb2.GenerateRequest(prompt="x"), None, ACME).request_id
        for _ in range(3)
    }
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    submit = prep.submit_request(generation_pb2.GenerateRequest(prompt="x"), None, ACME)
    assert submit.priority == common_pb2.PRIORITY_CLASS_INTERACTIVE


def test_a_prompt_of_token_ids_is_taken_as_it_is(tokenizer, prep):
    req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[5, 6, 7]))
    submit = prep.submit_request(req, None, ACME)
    assert list(submit.prompt_ids) == [5, 6, 7]


def test_chat_messages_are_tokenized_through_the_models_chat_template(tokenizer, prep):
    req = generation_pb2.GenerateRequest()
    req.messages.messages.add(role="system", content="Be brief.")
    req.messages.messages.add(role="user", content="Hi")
    submit = prep.submit_request(req, None, ACME)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert list(submit.prompt_ids) == tokenizer(text).input_ids
    assert submit.grammar.WhichOneof("kind") is None  # (nothing constrains the output)


def test_a_required_tool_call_constrains_the_output_with_a_grammar_of_the_tools(tokenizer, prep):
    req = generation_pb2.GenerateRequest()
    req.messages.messages.add(role="user", content="Weather in Oslo?")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    req.tools.add(name="weather", description="Today's weather", parameters=json.dumps(schema))
    req.tool_choice.mode = "required"
    submit = prep.submit_request(req, None, ACME)
    assert submit.grammar.WhichOneof("kind") == "lark"
    assert '"weather"' in submit.grammar.lark and '"city"' in submit.grammar.lark
    assert "weather" in tokenizer.decode(submit.prompt_ids)  # (the template renders the tools)
    req.tool_choice.mode = "auto"  # (the model may answer in text)
    assert prep.submit_request(req, None, ACME).grammar.WhichOneof("kind") is None


def test_max_tokens_left_unset_is_the_gateways_default_within_the_keys_cap(tokenizer, prep):
    unset = generation_pb2.GenerateRequest(prompt="x")
    assert prep.limits.default_max_tokens == 256
    assert prep.submit_request(unset, None, ACME).max_tokens == 256
    assert prep.submit_request(unset, None, ANONYMOUS).max_tokens == 256
    small = Principal("k3", "acme", "tiny", Tier(max_tokens=100))
    assert prep.submit_request(unset, None, small).max_tokens == 100
    assert prep.submit_request(unset, None, FREE).max_tokens == 256  # (its cap is 512)


def test_a_session_is_the_tenants_own_and_the_prefix_scope_follows_the_setting(tokenizer, prep):
    req = generation_pb2.GenerateRequest(prompt="x", session_id="chat-1")
    by_tenant = prep.submit_request(req, None, ACME)
    assert by_tenant.session_id == "acme:chat-1" and by_tenant.prefix_scope == "acme"
    shared = preparer(tokenizer, out_of_reach(), prefix_cache_scope="global")
    assert shared.submit_request(req, None, ACME).prefix_scope == ""
    anonymous = prep.submit_request(req, None, ANONYMOUS)
    assert anonymous.session_id == "chat-1" and anonymous.tenant == ""
    no_session = generation_pb2.GenerateRequest(prompt="x")
    assert prep.submit_request(no_session, None, ACME).session_id == ""


def test_the_clients_remaining_time_becomes_an_absolute_deadline(tokenizer, prep):
    before = int(time.time() * 1000)
    submit = prep.submit_request(generation_pb2.GenerateRequest(prompt="x"), 30.0, ACME)
    assert before + 30_000 <= submit.deadline_unix_ms <= time.time() * 1000 + 30_000


@pytest.mark.parametrize(
    "grammar,why",
    [
        (common_pb2.Grammar(regex="(unclosed"), ""),
        (common_pb2.Grammar(json_schema="{not json"), "json_schema: not valid JSON"),
        (common_pb2.Grammar(json_schema="[1, 2]"), "json_schema: a schema is a JSON object"),
        (common_pb2.Grammar(lark="start: undefined_rule"), ""),
    ],
    ids=["regex", "json", "not-a-schema", "lark"],
)
def test_a_grammar_that_cannot_be_used_is_refused_naming_the_grammar(tokenizer, prep, grammar, why):
    req = generation_pb2.GenerateRequest(prompt="x", grammar=grammar)
    e = refused(prep, req)
    assert e.field == "grammar" and str(e).startswith(f"grammar: {why}")
    assert len(str(e)) > len("grammar: ")  # (it says why)


def test_a_tools_schema_that_cannot_be_used_is_refused_naming_the_tool(tokenizer, prep):
    req = generation_pb2.GenerateRequest()
    req.messages.messages.add(role="user", content="Hi")
    req.tools.add(name="ok", parameters='{"type": "object"}')
    req.tools.add(name="bad", parameters='{"type": "no-such-type"}')
    assert refused(prep, req).field == "tools[1].parameters"


def test_a_request_no_verifiers_kv_budget_could_hold_is_refused_naming_max_tokens(
    tokenizer, redis_store
):
    prep = preparer(tokenizer, redis_store)
    req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[5] * 10))
    prep.submit_request(req, None, ACME)  # (no verifier registered: it may wait for one)
    req.max_tokens = 200
    redis_store.heartbeat(
        "v1", {"kv_budget": 128, "max_seq_len": 2048, "block_size": 16}, ttl_seconds=60
    )
    prep = preparer(tokenizer, redis_store)  # (the budget is read afresh)
    e = refused(prep, req)
    assert e.field == "max_tokens" and "more than any verifier has (128)" in str(e)
    req.max_tokens = 100
    assert prep.submit_request(req, None, ACME).max_tokens == 100  # (10 + 100 fits 128)


def test_a_prompt_that_leaves_no_room_for_output_is_refused_naming_the_prompt(tokenizer):
    prep = preparer(tokenizer, out_of_reach(), max_seq_len=8)
    req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[5] * 8))
    e = refused(prep, req)
    assert e.field == "prompt" and "max_seq_len is 8" in str(e)


def test_with_the_registry_out_of_reach_a_request_is_not_refused_for_its_size(prep):
    """(The scheduler queues it; admission never overcommits a verifier.)"""
    req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[5] * 1000))
    req.max_tokens = 1024
    assert prep.submit_request(req, None, ACME).max_tokens == 1024
