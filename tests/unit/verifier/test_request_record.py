"""A request's record as the verifier reads it (verifier/server.py): the running sequence
built from the typed `SubmitRequest`, as the scheduler stored it, and its grammar."""

from __future__ import annotations

import json

from specserve.store import RequestRecord, spec_json
from specserve.v1 import common_pb2, scheduler_pb2
from specserve.verifier.server import constrain, sequence_from_record


def record(request: scheduler_pb2.SubmitRequest | dict) -> RequestRecord:
    spec = json.loads(spec_json(request))
    return RequestRecord("r", spec, "running", "interactive", "1-0", "v", 0, 5, 6, False)


def test_a_sequence_reads_every_field_of_its_request_as_the_client_set_it():
    request = scheduler_pb2.SubmitRequest(
        request_id="r",
        prompt_ids=[5, 6, 7],
        max_tokens=9,
        stop=["\n\n"],
        deadline_unix_ms=1_800_000_000_123,  # (int64: a string in the JSON mapping)
        session_id="s",
        tenant="t",
        prefix_scope="t",
        logprobs=True,
        top_logprobs=3,
    )
    request.sampling.temperature = 0.7
    request.sampling.top_p = 0.9
    request.sampling.top_k = 4
    request.sampling.seed = 0  # (set, though zero)
    request.speculation.mode = common_pb2.SPECULATION_MODE_OFF
    request.speculation.tree_size = 0
    seq = sequence_from_record(record(request), restored=[11, 12])
    assert (seq.prompt_ids, seq.max_tokens, seq.stop) == ([5, 6, 7], 9, ["\n\n"])
    assert seq.params.temperature == 0.7 and seq.params.top_p == 0.9  # (not 0.699999988)
    assert seq.params.top_k == 4 and seq.params.seed == 0
    assert not seq.speculate and seq.tree_size == 0
    assert seq.deadline_ms == 1_800_000_000_123
    assert (seq.session_id, seq.tenant, seq.prefix_scope) == ("s", "t", "t")
    assert seq.logprobs and seq.top_logprobs == 3 and len(seq.output_logprobs) == 2
    assert seq.output_ids == [11, 12] and seq.restored == 2


def test_unset_options_read_as_unset():
    seq = sequence_from_record(record({"prompt_ids": [1], "max_tokens": 2}), restored=[])
    assert seq.params.seed is None and seq.tree_size is None and seq.speculate
    assert seq.params.temperature == 0.0 and seq.deadline_ms == 0 and not seq.logprobs


def test_no_grammar_or_an_empty_one_leaves_the_sequence_unbound():
    for spec in (
        {"prompt_ids": [1], "max_tokens": 2},
        {"prompt_ids": [1], "max_tokens": 2, "grammar": {}},
    ):
        rec = record(spec)
        seq = sequence_from_record(rec, restored=[])
        constrain(seq, rec, grammars=None, eos_ids=set())
        assert seq.constraint is None and seq.finish_reason is None


def test_a_grammar_of_a_kind_this_verifier_does_not_know_ends_the_request():
    """A newer gateway's kind of grammar is not dropped (the output would run unbound)."""
    rec = record({"prompt_ids": [1], "max_tokens": 2, "grammar": {"ebnf": "root ::= 'a'"}})
    seq = sequence_from_record(rec, restored=[])
    constrain(seq, rec, grammars=None, eos_ids=set())
    assert seq.finish_reason == "FINISH_REASON_ERROR" and seq.error.startswith("grammar: ")
