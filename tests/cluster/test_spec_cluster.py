"""Speculative decoding through the whole cluster: real drafter and verifier processes."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import generate, request, scrape, wait_until
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.cluster  # every test here runs a cluster

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "a b c a b c a b", "SELECT * FROM"]
# Where the tiny draft (tiny_draft_dir) picks the tiny target's next token part of the time
# (about a fifth to two fifths of it, greedy): drafts are both accepted and rejected.
PARTLY_AGREED = ["import numpy as np\n", "x = 1\n", "import os\n"]


def start(tmp_path, model_dir, draft_dir, **sections):
    config = cluster_config(model_dir, **sections)
    config["verifier"].update(
        speculative_decoding=True, verification_tree_size=8, speculation_policy="fixed"
    )
    config["drafter"].update(draft_model_path=str(draft_dir))
    return LocalCluster(config, tmp_path).start(timeout=180)


@pytest.fixture
def stub_of():
    channels = []

    def make(cluster):
        channels.append(grpc.insecure_channel(cluster.procs["gateway"].address))
        return generation_pb2_grpc.GenerationServiceStub(channels[-1])

    yield make
    for channel in channels:
        channel.close()


def generate_all(stub, jobs: list[list[int]], max_tokens: int):
    """The prompts' results, all requested at once."""
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        return list(
            pool.map(
                lambda ids: generate(stub, request(prompt_ids=ids, max_tokens=max_tokens)), jobs
            )
        )


@pytest.mark.parametrize(
    "proposer,shape",
    [
        ("draft_model", {"branching": 2, "width": 4}),
        ("draft_model", {"branching": 1, "width": 1}),
        ("ngram", {}),
        ("suffix", {}),
        ("hybrid", {"branching": 2, "width": 4}),
        ("hybrid", {"branching": 1, "width": 1, "run_ahead": True}),
    ],
    ids=["draft-tree", "draft-chain", "ngram", "suffix", "hybrid", "hybrid-run-ahead"],
)
def test_concurrent_greedy_requests_equal_the_targets_output(
    tmp_path, stub_of, tiny_model_dir, tiny_model, tokenizer, proposer, shape
):
    cluster = start(
        tmp_path,
        tiny_model_dir,
        tiny_model_dir,
        drafter={"proposer": proposer, "metrics_port": 0, **shape},
        verifier={"metrics_port": 0},
    )
    try:
        stub = stub_of(cluster)
        jobs = [tokenizer(p).input_ids for p in PROMPTS[:3]]
        results = generate_all(stub, jobs, 40)
        for ids, res in zip(jobs, results, strict=True):
            assert res.ids == hf_greedy(tiny_model, ids, 40)
            stats = res.final.speculation
            assert stats.fallback_steps == 0
            assert stats.steps * stats.mean_accepted_length == pytest.approx(len(res.ids))
        drafted = [r.final.speculation.drafted_tokens for r in results]
        accepted = sum(r.final.speculation.accepted_tokens for r in results)
        if proposer == "draft_model":  # the draft is the target itself: most drafts hold
            assert min(drafted) > 0 and accepted > 0.5 * sum(len(r.ids) for r in results)

        verifier = scrape(cluster.procs["verifier"].metrics_port)
        assert verifier["specserve_verifier_drafted_tokens_total"] == sum(drafted)
        assert verifier["specserve_verifier_accepted_tokens_total"] == accepted
        assert verifier["specserve_verifier_accepted_length_count"] > 0
        assert verifier["specserve_verifier_verify_seconds_count"] > 0
        assert verifier['specserve_gc_pause_seconds_count{generation="0"}'] > 0  # (every service)
        drafter = scrape(cluster.procs["drafter"].metrics_port)
        assert drafter["specserve_drafter_propose_seconds_count"] > 0
        if shape.get("run_ahead"):  # the draft is the target: steps go as assumed
            assert drafter['specserve_drafter_run_ahead_total{outcome="used"}'] > 0
        # A drafter with a draft model timed it as it started (its price for the verifiers)
        timed = "draft model timed" in cluster.procs["drafter"].log_text()
        assert timed == (proposer in ("draft_model", "hybrid"))
        off = generate(
            stub,
            request(
                prompt_ids=jobs[0],
                max_tokens=10,
                speculation=common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF),
            ),
        )
        assert off.ids == results[0].ids[:10]
        assert off.final.speculation.drafted_tokens == 0
        assert off.final.speculation.steps == 10

        sampling = common_pb2.SamplingParams(temperature=0.9, top_k=40, seed=21)
        seeded = [
            generate(stub, request(prompt_ids=jobs[1], max_tokens=30, sampling=sampling)).ids
            for _ in range(2)
        ]
        assert seeded[0] == seeded[1]
    finally:
        cluster.stop()


def test_completed_outputs_draft_the_next_request(tmp_path, stub_of, tiny_model_dir, tiny_model):
    """The drafter keeps a completed output (told with the verifier's last message for it),
    and the same request again drafts from it: fewer steps, the same, exact output."""
    cluster = start(
        tmp_path,
        tiny_model_dir,
        tiny_model_dir,
        drafter={"proposer": "suffix", "metrics_port": 0},
        verifier={"deep_tree_size": 64},
    )
    try:
        stub = stub_of(cluster)
        ids = [9707, 11, 1879, 0, 358, 1079]
        first = generate(stub, request(prompt_ids=ids, max_tokens=48))
        # (the drafter hears that it completed with the next step's message)
        again = generate(stub, request(prompt_ids=ids, max_tokens=48))
        assert first.ids == again.ids == hf_greedy(tiny_model, ids, 48)
        learned = scrape(cluster.procs["drafter"].metrics_port)["specserve_drafter_learned_tokens"]
        assert learned >= len(first.ids)
        assert again.final.speculation.steps < first.final.speculation.steps
        assert again.final.speculation.steps <= 8  # deep drafts: 48 tokens in a few steps
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "shape", [{"branching": 2, "width": 4}, {"branching": 1, "width": 1}], ids=["tree", "chain"]
)
def test_an_imperfect_draft_is_rejected_where_it_errs_and_the_output_stays_the_targets(
    tmp_path, stub_of, tiny_model_dir, tiny_draft_dir, tiny_model, tokenizer, shape
):
    """A draft model that is not the target: drafts are rejected over gRPC at every step
    where the draft errs, and the output is still the target's, token for token."""
    cluster = start(
        tmp_path,
        tiny_model_dir,
        tiny_draft_dir,
        drafter={"metrics_port": 0, **shape},
        verifier={"metrics_port": 0, "draft_timeout_seconds": 60},  # no fallback on a busy CPU
    )
    try:
        stub = stub_of(cluster)
        jobs = [tokenizer(p).input_ids for p in PARTLY_AGREED]
        results = generate_all(stub, jobs, 40)
        for ids, res in zip(jobs, results, strict=True):
            assert res.ids == hf_greedy(tiny_model, ids, 40)
            stats = res.final.speculation
            assert stats.fallback_steps == 0
            assert stats.drafted_tokens > stats.accepted_tokens > 0, stats
            assert stats.steps * stats.mean_accepted_length == pytest.approx(len(res.ids))
        verifier = scrape(cluster.procs["verifier"].metrics_port)
        drafted = sum(r.final.speculation.drafted_tokens for r in results)
        accepted = sum(r.final.speculation.accepted_tokens for r in results)
        assert verifier["specserve_verifier_drafted_tokens_total"] == drafted
        assert verifier["specserve_verifier_accepted_tokens_total"] == accepted

        # Seeded sampling through the rejection sampler. A random tiny model is nearly flat
        # (no top-32 draft would hold against it), so the target keeps its top token only:
        # p is a point mass and the output must be the greedy one; the draft samples at 0.02.
        sampling = common_pb2.SamplingParams(temperature=0.02, top_k=1, seed=21)
        sampled = [
            generate(stub, request(prompt_ids=ids, max_tokens=40, sampling=sampling))
            for ids in jobs
        ]
        assert [r.ids for r in sampled] == [r.ids for r in results]
        drafted = sum(r.final.speculation.drafted_tokens for r in sampled)
        accepted = sum(r.final.speculation.accepted_tokens for r in sampled)
        assert drafted > accepted > 0, (drafted, accepted)
    finally:
        cluster.stop()


def test_killing_the_drafter_mid_stream_changes_nothing_the_client_sees(
    tmp_path, stub_of, tiny_model_dir, tiny_draft_dir, tiny_model, tokenizer
):
    cluster = start(
        tmp_path,
        tiny_model_dir,
        tiny_draft_dir,
        verifier={"breaker_failures": 2, "breaker_cooldown_seconds": 0.5},
    )
    try:
        stub = stub_of(cluster)
        ids = tokenizer(PROMPTS[0]).input_ids
        stream = stub.Generate(request(prompt_ids=ids, max_tokens=600), timeout=120)
        chunks = [next(stream)]
        drafter_port = cluster.procs["drafter"].port
        cluster.kill("drafter")
        chunks.extend(stream)
        got = [t for c in chunks for t in c.token_ids]
        assert got == hf_greedy(tiny_model, ids, 600)
        assert [c.first_index for c in chunks] == [
            sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))
        ]
        assert chunks[-1].final.speculation.fallback_steps > 0
        assert chunks[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH

        # A drafter back on the same address: the verifier resyncs and drafts again.
        cluster.start_service("drafter", port=drafter_port)
        cluster.wait_ready("drafter", 120)
        res = generate(stub, request(prompt_ids=ids, max_tokens=40))
        assert res.ids == got[:40]
        for _ in range(20):
            if res.final.speculation.drafted_tokens > 0:
                break
            res = generate(stub, request(prompt_ids=ids, max_tokens=40))
        assert res.final.speculation.drafted_tokens > 0
    finally:
        cluster.stop()


def test_a_stalled_drafter_is_not_waited_for(
    tmp_path, stub_of, tiny_model_dir, tiny_draft_dir, tiny_model, tokenizer
):
    cluster = start(
        tmp_path,
        tiny_model_dir,
        tiny_draft_dir,
        verifier={
            "draft_timeout_seconds": 0.3,
            "breaker_failures": 2,
            "breaker_cooldown_seconds": 0.5,
        },
    )
    try:
        stub = stub_of(cluster)
        ids = tokenizer(PROMPTS[1]).input_ids
        drafter = cluster.procs["drafter"].popen
        stream = stub.Generate(request(prompt_ids=ids, max_tokens=300), timeout=120)
        chunks = [next(stream)]
        drafter.send_signal(signal.SIGSTOP)  # alive, holding its stream, answering nothing
        resume = threading.Timer(1.5, drafter.send_signal, (signal.SIGCONT,))
        resume.start()
        chunks.extend(stream)
        got = [t for c in chunks for t in c.token_ids]
        assert got == hf_greedy(tiny_model, ids, 300)
        assert chunks[-1].final.speculation.fallback_steps > 0
        # Back from the stall, its late answers are dropped and it drafts again.
        resume.join()

        def drafts_again():
            res = generate(stub, request(prompt_ids=ids, max_tokens=40))
            assert res.ids == got[:40]
            return res.final.speculation.drafted_tokens > 0

        wait_until(drafts_again, "drafts after the stall", timeout=60)
    finally:
        cluster.stop()


def test_drafters_join_and_leave_while_requests_stream(
    tmp_path, stub_of, tiny_model_dir, tiny_model, tokenizer
):
    cluster = start(
        tmp_path,
        tiny_model_dir,
        tiny_model_dir,
        drafter={"metrics_port": 0},
        verifier={"metrics_port": 0, "breaker_failures": 2, "breaker_cooldown_seconds": 0.5},
    )
    try:
        stub = stub_of(cluster)
        jobs = [tokenizer(p).input_ids for p in PROMPTS]
        expected = {tuple(ids): hf_greedy(tiny_model, ids, 300) for ids in jobs}
        verifier_metrics = cluster.procs["verifier"].metrics_port

        def run_all(during=None) -> None:
            streams = [
                stub.Generate(request(prompt_ids=ids, max_tokens=300), timeout=120) for ids in jobs
            ]
            firsts = [next(s) for s in streams]
            if during:
                during()
            for ids, first, stream in zip(jobs, firsts, streams, strict=True):
                got = list(first.token_ids) + [t for c in stream for t in c.token_ids]
                assert got == expected[tuple(ids)]

        # A second drafter joins: the verifier finds it in the registry, without a restart.
        cluster.start_service("drafter", instance="drafter2")
        registry = redis.Redis.from_url(cluster.redis_url)
        wait_until(lambda: registry.scard("specserve:drafters") == 2, "two drafters registered")
        run_all()
        assert scrape(verifier_metrics)["specserve_verifier_drafters"] == 2
        proposals = {
            key: scrape(cluster.procs[key].metrics_port)["specserve_drafter_propose_seconds_count"]
            for key in ("drafter", "drafter2")
        }
        assert min(proposals.values()) > 0, proposals  # both took sequences

        # One is killed mid-stream: its sequences resync on the other; nothing fails.
        run_all(during=lambda: cluster.kill("drafter"))
        after = scrape(cluster.procs["drafter2"].metrics_port)
        assert after["specserve_drafter_propose_seconds_count"] > proposals["drafter2"]
        # The last one leaves with SIGTERM: plain decoding carries on.
        run_all(during=lambda: cluster.kill("drafter2", signal.SIGTERM))
        res = generate(stub, request(prompt_ids=jobs[0], max_tokens=20))
        assert res.ids == expected[tuple(jobs[0])][:20]
    finally:
        cluster.stop()
