"""Tensor parallelism on the CPU: 2 gloo ranks, each a real process holding half the model.

The contract: a verifier over 2 ranks computes what one computes (logits to float32 rounding,
greedy outputs token for token, trees, batches, prefix reuse and preemption included), each
rank holds about half the weights, and a rank that dies takes the verifier down as a group
without losing or repeating a token of any request."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types

import grpc
import pytest
import torch
import yaml
from transformers import Qwen2Config

from conftest import DEVICE, cluster_config
from helpers import Client, children, generate, request, scrape, wait_until
from specserve.engine import models
from specserve.engine.flat_model import FlatModel, Segment
from specserve.engine.tensor_parallel import ShardError, rank_devices, shard_config
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import generation_pb2_grpc
from specserve.verifier.ranks import Ranks, RanksFailed
from specserve.verifier.reference import hf_greedy

# Ranks are processes of their own.
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU"),
]


def ranks_of(pid: int) -> list[int]:
    """The tensor-parallel ranks process `pid` launched."""
    found = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"specserve.verifier.ranks" in f.read():
                    found.append(child)
        except OSError:
            continue
    return found


def rank_settings(timeout_s: float = 60.0):
    return types.SimpleNamespace(
        tensor_parallel=2,
        tensor_parallel_timeout_seconds=timeout_s,
        dtype="float32",
        device="cpu",
        torch_threads=1,
        compile=False,
        attention="auto",
        log_level="WARNING",
    )


# --- what cannot be split, refused with the numbers ------------------------------------------
def test_a_rank_count_that_does_not_divide_the_model_is_refused_with_the_numbers():
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    with pytest.raises(
        ShardError, match=r"tensor_parallel: 3 does not divide .*attention heads \(4\)"
    ):
        shard_config(config, 3)
    with pytest.raises(ShardError, match=r"4 does not divide the model's KV heads \(2\).* 1, 2$"):
        shard_config(config, 4)
    odd = Qwen2Config(vocab_size=151665, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ShardError, match=r"2 does not divide the model's vocabulary \(151665\)"):
        shard_config(odd, 2)
    shard = shard_config(config, 2)
    assert (shard.num_attention_heads, shard.num_key_value_heads) == (2, 1)
    assert (shard.intermediate_size, shard.vocab_size, shard.head_dim) == (64, 512, 16)


def test_more_ranks_than_visible_cuda_devices_is_refused():
    with pytest.raises(ValueError, match=r"4 ranks from cuda need cuda:0..cuda:3, and 2 CUDA"):
        rank_devices("cuda", 4, visible=2)
    with pytest.raises(ValueError, match=r"2 ranks from cuda:1 need cuda:1..cuda:2, and 2 CUDA"):
        rank_devices("cuda:1", 2, visible=2)
    assert rank_devices("cuda:1", 2, visible=3) == ["cuda:1", "cuda:2"]
    assert rank_devices("cpu", 2, visible=0) == ["cpu", "cpu"]


def test_a_verifier_whose_model_does_not_split_stops_at_start_naming_the_key(
    tmp_path, tiny_model_dir
):
    """The tiny model has 4 heads: 3 ranks cannot split it. Nothing starts (no Redis is
    needed to find out) and the message says what would."""
    config = cluster_config(tiny_model_dir, verifier={"tensor_parallel": 3})
    path = tmp_path / "specserve.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "specserve.tools.cli", "--config", str(path), "serve", "verifier"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 1
    assert "verifier.tensor_parallel: 3 does not divide the model's attention heads (4)" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr.split("failed to start:")[-1]


# --- ranks that never meet -------------------------------------------------------------------
def test_a_rank_that_hangs_before_joining_fails_the_start_within_the_timeout(tiny_model_dir):
    """Rank 1 is stopped (SIGSTOP) as soon as it exists, long before it can join (importing
    torch alone takes it a second): the launch fails after the timeout, naming the rank and
    the key, and leaves no process behind."""
    found: list[int] = []

    def stop_rank_1() -> None:
        wait_until(lambda: ranks_of(os.getpid()), "rank 1 started", timeout=30, every=0.005)
        found.extend(ranks_of(os.getpid()))
        for pid in found:
            os.kill(pid, signal.SIGSTOP)

    stopper = threading.Thread(target=stop_rank_1)
    stopper.start()
    with pytest.raises(RanksFailed, match=r"rank\(s\) 1 of 2 not joined within 3 s .*timeout"):
        Ranks.launch(tiny_model_dir, rank_settings(timeout_s=3))
    stopper.join()
    assert found and not any(pid in ranks_of(os.getpid()) for pid in found)


# --- one model over two ranks ----------------------------------------------------------------
EXCHANGE_TIMEOUT_S = 8.0  # short: an idle group must outlive it (see below)


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir):
    """Rank 0 here (this process), rank 1 a process of its own: a FlatModel over both."""
    ranks = Ranks.launch(tiny_model_dir, rank_settings(EXCHANGE_TIMEOUT_S))
    try:
        shard = models.load_model(tiny_model_dir, "cpu", "float32", shard=(0, 2))
        loaded = {0: models.weight_bytes(shard), **ranks.loaded()}
        yield FlatModel(shard, shards=ranks.shards), loaded
    finally:
        ranks.close()


def test_each_rank_holds_half_the_weights(two_ranks, tiny_model):
    _, loaded = two_ranks
    whole = models.weight_bytes(tiny_model)
    norms = [p for n, p in tiny_model.named_parameters() if "norm" in n]
    replicated = sum(  # every rank holds the norms and the rotary frequencies
        t.numel() * t.element_size() for t in [*norms, *tiny_model.buffers()]
    )
    assert loaded[0] == loaded[1] == (whole - replicated) // 2 + replicated


def test_an_idle_group_waits_for_its_next_step_past_the_exchange_timeout(two_ranks):
    """The exchange timeout bounds a step, not the wait for one: a verifier with no work for
    longer than it still runs its next step over both ranks."""
    sharded, _ = two_ranks
    kv = sharded.new_kv()
    try:
        (before,) = sharded.forward([Segment(kv, [1, 2, 3])])
        # The sleep is the condition under test, not a wait for an event: a group with no
        # work for longer than its exchange timeout (there is nothing to observe meanwhile).
        time.sleep(1.5 * EXCHANGE_TIMEOUT_S)
        (after,) = sharded.forward([Segment(kv, [4])])
        assert before.shape == after.shape and sharded.shards.lost is None
    finally:
        kv.free()


def test_two_ranks_compute_what_one_does_step_after_step(two_ranks, tiny_model):
    """Random steps over several sequences (a shared prefix reused from the cache, prompts,
    draft trees whose accepted paths are kept, rollbacks, frees) on one rank and on two: every
    logit row agrees to float32 rounding and every argmax is the same."""
    sharded, _ = two_ranks
    whole = FlatModel(tiny_model)
    pools = [m.use_pool(2048, 4, fixed=True) for m in (whole, sharded)]
    rng = random.Random(0)
    vocab = tiny_model.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(13)]
    live: list[list] = []  # [kv on one rank, kv on two, pending token ids]
    rows = 0
    for _ in range(60):
        if live and (rng.random() < 0.08 or len(live) > 4):
            for kv in live.pop(rng.randrange(len(live)))[:2]:
                kv.free()
        if not live or rng.random() < 0.2:
            ids = system + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            pair = [whole.new_kv(), sharded.new_kv()]
            reused = {kv.reuse(ids) for kv in pair}
            assert len(reused) == 1
            live.append([*pair, ids[reused.pop() :]])
        trees = []
        for entry in live:
            feed = entry[2] or [rng.randrange(vocab)]
            entry[2] = []
            tree = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            trees.append((feed, tree))
        out = [
            model.forward(
                [
                    Segment(entry[i], feed + tree, logits_from=len(feed) - 1)
                    for entry, (feed, tree) in zip(live, trees, strict=True)
                ]
            )
            for i, model in enumerate((whole, sharded))
        ]
        for one, two in zip(*out, strict=True):
            torch.testing.assert_close(two, one, atol=2e-5, rtol=1e-5)
            assert torch.equal(one.argmax(-1), two.argmax(-1))
            rows += len(one)
        for entry, (_, tree) in zip(live, trees, strict=True):
            path = sorted(rng.sample(range(len(tree)), rng.randint(0, len(tree))))
            if rng.random() < 0.1:
                path = []
            for kv in entry[:2]:
                kv.keep(kv.length - len(tree), path)
                kv.seal(system)  # the shared prefix's full blocks are cached
            if rng.random() < 0.05:
                for kv in entry[:2]:
                    kv.truncate(max(1, kv.length - 3))  # (the next step recomputes nothing)
    for entry in live:
        for kv in entry[:2]:
            kv.free()
    assert rows > 300 and pools[1].hits == pools[0].hits > 0


# --- the verifier over two ranks, in the cluster ---------------------------------------------
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "a b c a b c a b", "SELECT * FROM"]


def tp_cluster(tmp_path, model_dir, **verifier):
    config = cluster_config(
        model_dir,
        verifier={
            "speculative_decoding": True,
            "verification_tree_size": 8,
            "speculation_policy": "fixed",
            "tensor_parallel": 2,
            "metrics_port": 0,
            **verifier,
        },
        drafter={"proposer": "draft_model", "branching": 2, "width": 4},
    )
    return LocalCluster(config, tmp_path).start(timeout=240)


def test_greedy_over_two_ranks_equals_the_targets_own_output(
    tmp_path, tiny_model_dir, tiny_model, tokenizer
):
    """Eight requests at once on a verifier of 2 ranks, with the draft model's trees, a shared
    system prompt and a KV pool that holds one of them and a bit (so they are preempted and
    recomputed): each output is Hugging Face generate's, token for token."""
    system = "# A helper module.\n# Every function below is documented and tested.\n\n"
    jobs = [tokenizer(system + p).input_ids for p in PROMPTS] * 2
    need = max(len(ids) for ids in jobs) + 48  # a request's worst case, and 2 blocks more:
    budget = -(-(need + 32) // 16) * 16  # two requests that grow at once cannot both fit
    cluster = tp_cluster(tmp_path, tiny_model_dir, batch_size=4, kv_budget_tokens=budget)
    try:
        channel = grpc.insecure_channel(cluster.procs["gateway"].address)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        # One first, so the system prompt's blocks are cached whatever the others' timing
        # (eight at once may all prefill before any of them has cached a block).
        warm = generate(stub, request(prompt_ids=jobs[0], max_tokens=48))
        assert warm.ids == hf_greedy(tiny_model, jobs[0], 48)
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(
                pool.map(lambda ids: generate(stub, request(prompt_ids=ids, max_tokens=48)), jobs)
            )
        for ids, res in zip(jobs, results, strict=True):
            assert res.ids == hf_greedy(tiny_model, ids, 48)
        metrics = scrape(cluster.procs["verifier"].metrics_port)
        assert metrics["specserve_verifier_tensor_parallel_ranks"] == 2
        assert metrics["specserve_verifier_drafted_tokens_total"] > 0
        assert metrics["specserve_verifier_accepted_tokens_total"] > 0
        assert metrics["specserve_verifier_prefix_cache_tokens_total"] > 0
        assert metrics["specserve_verifier_preemptions_total"] > 0
        halves = [metrics[f'specserve_verifier_weight_bytes{{rank="{r}"}}'] for r in (0, 1)]
        assert halves[0] == halves[1] < 0.51 * models.weight_bytes(tiny_model)
        channel.close()
    finally:
        cluster.stop()


def test_a_rank_killed_mid_stream_loses_and_repeats_nothing(
    tmp_path, tiny_model_dir, tiny_model, tokenizer
):
    """Rank 1 of the verifier serving four streams is killed. The verifier hands its requests
    back and exits non-zero (to be restarted as a group); a second verifier finishes them:
    every index arrives once and every output is the target's own."""
    cluster = tp_cluster(tmp_path, tiny_model_dir, batch_size=8)
    try:
        store = RequestStore.from_url(cluster.redis_url)
        address = cluster.procs["gateway"].address
        clients = [
            Client(f"tp-{i}", tokenizer(PROMPTS[i]).input_ids, 300) for i in range(len(PROMPTS))
        ]
        threads = [threading.Thread(target=c.run, args=(address,), daemon=True) for c in clients]
        for t in threads:
            t.start()
        wait_until(lambda: all(c.received >= 8 for c in clients), "4 streams under way", 120)
        verifier = cluster.procs["verifier"]
        assert len(store.owned(verifier.address)) == len(clients)
        (rank_1,) = ranks_of(verifier.popen.pid)
        os.kill(rank_1, signal.SIGKILL)
        assert verifier.popen.wait(timeout=60) == 1
        log = verifier.log_text()
        assert "rank 1 exited (killed by SIGKILL)" in log and "handed back" in log
        cluster.start_service(
            "verifier", {"SPECSERVE_VERIFIER_TENSOR_PARALLEL": "1"}, instance="v2"
        )
        cluster.wait_ready("v2", 120)
        for t in threads:
            t.join(timeout=300)
        for c in clients:
            assert c.error == "" and c.final is not None
            indices = c.indices()
            assert sorted(indices) == list(range(len(c.ids())))  # each once, none missing
            assert c.ids() == hf_greedy(tiny_model, c.prompt_ids, 300)
            assert store.get(c.rid).requeues >= 1
    finally:
        cluster.stop()
