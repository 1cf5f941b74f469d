"""Log-probabilities of the generated tokens, over gRPC and the OpenAI API: the target's own,
equal with speculation on and off, equal to HF's forward pass over the same tokens, greedy
and sampled; and what a bad request gets."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from helpers import generate, request
from specserve.common import logprob_format as wire
from specserve.speculation.acceptance import Verdict
from specserve.speculation.tree import DraftTree
from specserve.v1 import common_pb2
from specserve.verifier import logprobs

TOP = 5
TOLERANCE = 1e-4  # float32: a tree's row and plain decoding's row for a position differ in rounding
OFF = common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF)


def reference(model, prompt: list[int], output: list[int], top: int):
    """HF's log-softmax over the vocabulary at each output position: per token (its own
    log-probability, the top `top` (id, log-probability))."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    best = lp.topk(top, -1)
    return [
        (lp[i, t].item(), list(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True)))
        for i, t in enumerate(output)
    ]


def assert_matches(got, expected) -> None:
    """gRPC TokenLogprobs against `reference`'s entries."""
    assert len(got) == len(expected)
    for entry, (own, top) in zip(got, expected, strict=True):
        assert entry.logprob == pytest.approx(own, abs=TOLERANCE)
        assert [t.logprob for t in entry.top] == pytest.approx([x for _, x in top], abs=TOLERANCE)
        # Ties aside (equal values may come in either order), the same tokens.
        for t, (i, x) in zip(entry.top, top, strict=True):
            assert t.token_id == i or t.logprob == pytest.approx(x, abs=TOLERANCE)


def test_a_steps_rows_score_the_accepted_path_and_the_bonus():
    """The rows each emitted token was chosen from: row 0, then the row after each accepted
    node; the top tokens sorted, the entry's own value the log-softmax's."""
    torch.manual_seed(0)
    tree = DraftTree([5, 6, 7], [-1, 0, 0])
    logits = torch.randn(4, 50)
    verdict = Verdict(accepted=[0, 2], tokens=[5, 7, 9])  # root -> node 0 -> node 2, bonus 9
    logprobs.score([logits], [verdict], [3])
    lp = torch.log_softmax(logits, -1)
    for entry, row, token in zip(verdict.logprobs, [0, 1, 3], [5, 7, 9], strict=True):
        own, top = wire.decode(entry)
        assert own == pytest.approx(lp[row, token].item(), abs=1e-6)
        ids = lp[row].topk(3).indices.tolist()
        assert [i for i, _ in top] == ids
        assert [x for _, x in top] == pytest.approx(lp[row, ids].tolist(), abs=1e-6)
    assert len(tree) == 3
    lone = Verdict(accepted=[], tokens=[1])
    logprobs.score([logits[:1]], [lone], [0])
    assert wire.decode(lone.logprobs[0]) == (pytest.approx(lp[0, 1].item(), abs=1e-6), [])
    assert math.isnan(wire.decode(wire.UNKNOWN)[0])


@pytest.mark.cluster
def test_greedy_logprobs_are_the_targets_with_speculation_on_and_off(
    drafting_stub, tokenizer, tiny_model
):
    prompt = tokenizer("import numpy as np\n").input_ids
    on = generate(drafting_stub, request(prompt, max_tokens=24, logprobs=True, top_logprobs=TOP))
    off = generate(
        drafting_stub,
        request(prompt, max_tokens=24, logprobs=True, top_logprobs=TOP, speculation=OFF),
    )
    assert on.final.speculation.accepted_tokens > 0  # tree rows were scored
    assert on.final.speculation.drafted_tokens > on.final.speculation.accepted_tokens
    assert off.final.speculation.drafted_tokens == 0
    assert on.ids == off.ids
    expected = reference(tiny_model, prompt, on.ids, TOP)
    for result in (on, off):
        got = [e for c in result.chunks for e in c.logprobs]
        assert [e.token_id for e in got] == result.ids
        assert_matches(got, expected)
        for e in got:  # greedy: the token is the most likely one
            assert e.logprob == pytest.approx(e.top[0].logprob, abs=1e-6)
            assert sum(math.exp(t.logprob) for t in e.top) <= 1 + 1e-5
    plain = generate(drafting_stub, request(prompt, max_tokens=24))
    assert plain.ids == on.ids and not any(c.logprobs for c in plain.chunks)


@pytest.mark.cluster
def test_sampled_tokens_get_the_targets_logprobs(drafting_stub, tokenizer, tiny_model):
    prompt = tokenizer("x = 1\n").input_ids
    sampling = common_pb2.SamplingParams(temperature=0.8, seed=7)
    result = generate(
        drafting_stub,
        request(prompt, max_tokens=20, sampling=sampling, logprobs=True, top_logprobs=2),
    )
    assert result.final.speculation.drafted_tokens > 0
    got = [e for c in result.chunks for e in c.logprobs]
    assert_matches(got, reference(tiny_model, prompt, result.ids, 2))


@pytest.mark.cluster
def test_the_openai_client_gets_logprobs_streamed_and_not(drafting_api, drafting_stub, tokenizer):
    model = drafting_api.models.list().data[0].id
    messages = [{"role": "user", "content": "Write a haiku about tests."}]
    kwargs = dict(model=model, messages=messages, max_tokens=12, temperature=0)
    whole = drafting_api.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-6)  # greedy
        assert entry.bytes == list(entry.token.encode())
    streamed = []
    for chunk in drafting_api.chat.completions.create(
        **kwargs, logprobs=True, top_logprobs=3, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert drafting_api.chat.completions.create(**kwargs).choices[0].logprobs is None

    # The same numbers as gRPC gives for the same prompt.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text).input_ids  # (as the gateway renders it)
    grpc_result = generate(drafting_stub, request(ids, max_tokens=12, logprobs=True))
    got = [e for c in grpc_result.chunks for e in c.logprobs]
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in got], abs=1e-6)

    completion = drafting_api.completions.create(
        model=model, prompt="def add(a, b):", max_tokens=8, temperature=0, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


@pytest.mark.cluster
@pytest.mark.parametrize(
    "extra,param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_bad_logprobs_are_refused_by_name(drafting_api, extra, param):
    model = drafting_api.models.list().data[0].id
    with pytest.raises(Exception) as refused:
        drafting_api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
        )
    assert refused.value.status_code == 400 and param in str(refused.value)


@pytest.mark.cluster
def test_grpc_refuses_more_than_twenty_top_logprobs(drafting_stub):
    with pytest.raises(grpc.RpcError) as refused:
        generate(drafting_stub, request([1, 2, 3], max_tokens=2, logprobs=True, top_logprobs=21))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_logprobs" in refused.value.details()
