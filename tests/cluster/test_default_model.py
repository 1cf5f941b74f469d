"""The default pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, float32) through the
whole cluster: greedy output with speculation on and off equals plain Hugging Face."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from conftest import DEVICE, cluster_config, default_target_dir
from helpers import generate, request, scrape
from specserve.engine import models
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

pytestmark = [pytest.mark.default_model, pytest.mark.cluster]


def test_default_pair_greedy_matches_hf_with_speculation_on_and_off(tmp_path, tokenizer):
    config = cluster_config(
        None,
        verifier={"batch_size": 2, "torch_threads": 0, "speculative_decoding": True},
        drafter={"max_depth": 4, "dtype": "int8" if DEVICE == "cpu" else "float32"},
    )
    cluster = LocalCluster(config, tmp_path)
    try:
        cluster.start(timeout=300)
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
            assert info.sha256 == models.CATALOG[(info.name, info.version)].sha256
            results = {}
            for mode in (common_pb2.SPECULATION_MODE_AUTO, common_pb2.SPECULATION_MODE_OFF):
                req = request(max_tokens=12, speculation=common_pb2.SpeculationOptions(mode=mode))
                req.messages.messages.add(role="user", content="Write a haiku about Redis.")
                results[mode] = generate(stub, req, timeout=300)
        # (the draft model's drafter timed it as it started; the adaptive policy prices it so)
        assert "draft model priced by its drafter" in cluster.procs["verifier"].log_text()
    finally:
        cluster.stop()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about Redis."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    model = models.load_model(default_target_dir(), DEVICE, "float32")
    expected = hf_greedy(model, tokenizer(text).input_ids, 12)
    on, off = results[common_pb2.SPECULATION_MODE_AUTO], results[common_pb2.SPECULATION_MODE_OFF]
    assert on.ids == expected
    assert off.ids == expected
    assert on.text.strip()
    assert on.final.speculation.drafted_tokens > 0
    assert on.final.speculation.accepted_tokens > 0
    assert on.final.speculation.steps < 12
    assert off.final.speculation.drafted_tokens == 0


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU (NCCL needs a GPU per rank)")
def test_the_default_target_over_two_ranks_matches_hf(tmp_path, tokenizer):
    """The 1.5B target split over 2 gloo ranks (float32), two requests at once, drafted by the
    suffix proposer (the first copies its prompt, so trees are accepted): Hugging Face's greedy
    output, token for token; each rank holds about half the weights."""
    prompts = [
        "Repeat this line three times, nothing else:\nthe quick brown fox jumps over the lazy dog",
        "Write a haiku about Redis.",
    ]
    config = cluster_config(
        None,
        verifier={
            "batch_size": 2,
            "speculative_decoding": True,
            "speculation_policy": "fixed",  # (adaptive may find no tree pays on this CPU)
            "tensor_parallel": 2,
            "metrics_port": 0,
        },
        drafter={"proposer": "suffix"},
    )
    cluster = LocalCluster(config, tmp_path)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    jobs = [tokenizer(t).input_ids for t in texts]
    try:
        cluster.start(timeout=300)
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with cf.ThreadPoolExecutor(2) as pool:
                results = list(
                    pool.map(
                        lambda ids: generate(stub, request(prompt_ids=ids, max_tokens=24), 600),
                        jobs,
                    )
                )
        metrics = scrape(cluster.procs["verifier"].metrics_port)
    finally:
        cluster.stop()
    model = models.load_model(default_target_dir(), DEVICE, "float32")
    for ids, res in zip(jobs, results, strict=True):
        assert res.ids == hf_greedy(model, ids, 24)
    assert results[0].final.speculation.accepted_tokens > 0  # (it copies the prompt's line)
    halves = [metrics[f'specserve_verifier_weight_bytes{{rank="{r}"}}'] for r in (0, 1)]
    assert halves[0] == halves[1] < 0.51 * models.weight_bytes(model)
