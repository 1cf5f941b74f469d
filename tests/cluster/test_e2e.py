"""End to end over real gRPC and a real Redis: all four services as separate processes."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from helpers import generate, request
from specserve.v1 import common_pb2
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.cluster  # every test here runs a cluster

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "Once upon a time",
    "SELECT * FROM",
    "你好，世界",
    "x = [1, 2, 3]",
    "# TODO:",
]


def test_greedy_matches_hf_generate(gateway, tokenizer, tiny_model):
    ids = tokenizer(PROMPTS[0]).input_ids
    res = generate(gateway, request(prompt_ids=ids, max_tokens=24))
    assert res.ids == hf_greedy(tiny_model, ids, 24)
    assert res.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert res.final.usage.prompt_tokens == len(ids)
    assert res.final.usage.completion_tokens == 24


def test_text_prompt_is_tokenized_like_the_tokenizer(gateway, tokenizer, tiny_model):
    res = generate(gateway, request(prompt=PROMPTS[1], max_tokens=8))
    assert res.ids == hf_greedy(tiny_model, tokenizer(PROMPTS[1]).input_ids, 8)


def test_stream_deltas_and_indices(gateway, tokenizer):
    res = generate(gateway, request(prompt=PROMPTS[5], max_tokens=40))
    index = 0
    for chunk in res.chunks:
        assert chunk.first_index == index
        index += len(chunk.token_ids)
        assert "\ufffd" not in chunk.text or "\ufffd" in tokenizer.decode(res.ids)
    assert index == 40
    assert res.text == tokenizer.decode(res.ids, skip_special_tokens=True)
    assert res.final.timings.ttft_ms > 0
    assert res.final.speculation.steps == 40


def test_concurrent_requests_all_complete_correctly(gateway, tokenizer, tiny_model):
    jobs = [(tokenizer(p).input_ids, 5 + 7 * i) for i, p in enumerate(PROMPTS)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(
            pool.map(
                lambda job: generate(gateway, request(prompt_ids=job[0], max_tokens=job[1])), jobs
            )
        )
    for (ids, n), res in zip(jobs, results, strict=True):
        assert res.ids == hf_greedy(tiny_model, ids, n)
        assert res.final.usage.completion_tokens == len(res.ids)


def test_stop_string_ends_generation_and_is_not_returned(gateway):
    base = generate(gateway, request(prompt=PROMPTS[2], max_tokens=30))
    text = base.text
    stop = text.strip()[:2]
    assert stop, f"degenerate sample text {text!r}"
    res = generate(gateway, request(prompt=PROMPTS[2], max_tokens=30, stop=[stop]))
    assert res.final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert res.text == text[: text.index(stop)]
    assert res.final.usage.completion_tokens < 30


def test_seeded_sampling_is_reproducible(gateway):
    def sample(seed: int):
        params = common_pb2.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed)
        return generate(gateway, request(prompt=PROMPTS[3], max_tokens=20, sampling=params)).ids

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other


def test_chat_messages_use_the_chat_template(gateway, tokenizer):
    req = request(max_tokens=4)
    req.messages.messages.add(role="user", content="hello")
    res = generate(gateway, req)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert res.final.usage.prompt_tokens == len(tokenizer(text).input_ids)


def test_same_request_id_attaches_to_the_same_request(gateway, tokenizer):
    ids = tokenizer(PROMPTS[4]).input_ids
    first = generate(gateway, request(prompt_ids=ids, max_tokens=12, request_id="attach-1"))
    second = generate(gateway, request(prompt_ids=ids, max_tokens=12, request_id="attach-1"))
    assert first.ids == second.ids
    assert second.chunks[0].request_id == "attach-1"


def test_model_info(gateway, tokenizer):
    from specserve.v1 import generation_pb2

    info = gateway.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == len(tokenizer)
    assert info.max_seq_len == 2048


def test_deadline_exceeded_reaches_the_client(gateway):
    with pytest.raises(grpc.RpcError) as err:
        generate(gateway, request(prompt=PROMPTS[0], max_tokens=1000), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_request_without_a_deadline_is_served(gateway):
    """No client deadline: gRPC reports an unbounded time remaining, which is not a deadline."""
    chunks = list(gateway.Generate(request(prompt="x = ", max_tokens=3)))
    assert chunks[-1].final.usage.completion_tokens == 3
