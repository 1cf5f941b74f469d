"""Serving under load through the whole cluster: continuous batching with chunked prefill, the KV
budget, priority classes, prefix-aware placement with the prefix cache, the result cache. The tests
of outputs run twice: plain decoding, and speculative with a draft model that is not the
target (drafts rejected where it errs); the outputs are the same."""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import generate, request, scrape, wait_until
from specserve.common.settings import SchedulerSettings
from specserve.scheduler.server import Placer
from specserve.store import RequestStore, now_ms, queued_key, req_key
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import (
    common_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specserve.verifier.reference import hf_greedy

BATCH = common_pb2.PRIORITY_CLASS_BATCH
# The same tests with speculation off and on (every step drafts a tree of 6, fixed).
SPECULATION = pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])


@pytest.fixture
def cluster_of(tmp_path, tiny_model_dir, tiny_draft_dir):
    """Starts a cluster of the tiny model with extra config (speculative: drafts from the
    tiny draft model); stops it (and its channels)."""
    started = []

    def start(
        services=None, speculative: bool = False, **sections
    ) -> tuple[LocalCluster, generation_pb2_grpc.GenerationServiceStub]:
        config = cluster_config(tiny_model_dir, **sections)
        if speculative:
            config["verifier"].update(
                speculative_decoding=True, speculation_policy="fixed", verification_tree_size=6
            )
            config["drafter"].update(draft_model_path=str(tiny_draft_dir))
        cluster = LocalCluster(config, tmp_path / f"c{len(started)}")
        started.append(cluster)
        cluster.start(timeout=180, **({"services": services} if services else {}))
        channel = grpc.insecure_channel(cluster.procs["gateway"].address)
        cluster.channels = [channel]
        return cluster, generation_pb2_grpc.GenerationServiceStub(channel)

    yield start
    for cluster in started:
        for channel in getattr(cluster, "channels", []):
            channel.close()
        cluster.stop()


def verifier_status(cluster, key: str = "verifier") -> verifier_pb2.StatusResponse:
    with grpc.insecure_channel(cluster.procs[key].address) as channel:
        return verifier_pb2_grpc.VerifierServiceStub(channel).Status(
            verifier_pb2.StatusRequest(), timeout=10
        )


def drafted_and_accepted(cluster) -> tuple[float, float]:
    metrics = scrape(cluster.procs["verifier"].metrics_port)
    return (
        metrics["specserve_verifier_drafted_tokens_total"],
        metrics["specserve_verifier_accepted_tokens_total"],
    )


@SPECULATION
@pytest.mark.cluster
def test_sequences_joining_and_leaving_mid_batch_keep_greedy_outputs(
    cluster_of, tiny_model, tokenizer, speculative
):
    """Arrivals one after another's first token, different lengths, prompts prefilled in
    chunks of 8 tokens next to running decodes: every output is what the model gives the
    request alone."""
    cluster, stub = cluster_of(
        verifier={"max_prefill_tokens": 8, "batch_size": 3, "metrics_port": 0},
        speculative=speculative,
    )
    rng = random.Random(7)
    texts = ["def quicksort(xs):", "The quick brown fox", "SELECT name FROM users WHERE"]
    jobs = []
    for i in range(7):
        ids = tokenizer(texts[i % 3] * (1 + i % 3)).input_ids + [rng.randrange(1000)] * (i * 3)
        jobs.append((ids, rng.randrange(5, 40)))
    streaming = [threading.Event() for _ in jobs]

    def run(i: int):
        """Job i arrives once job i-1 streams: it joins a batch that is decoding."""
        if i:
            assert streaming[i - 1].wait(timeout=120), f"job {i - 1} never streamed"
        ids, max_tokens = jobs[i]
        chunks = []
        for chunk in stub.Generate(request(prompt_ids=ids, max_tokens=max_tokens), timeout=120):
            chunks.append(chunk)
            streaming[i].set()
        return [t for c in chunks for t in c.token_ids]

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, range(len(jobs))))
    for (ids, max_tokens), got in zip(jobs, results, strict=True):
        assert got == hf_greedy(tiny_model, ids, max_tokens)
    metrics = scrape(cluster.procs["verifier"].metrics_port)
    chunks = sum(-(-len(ids) // 8) for ids, _ in jobs)
    assert metrics["specserve_verifier_prefill_chunks_total"] >= chunks
    assert metrics["specserve_verifier_prefill_tokens_total"] == sum(len(j[0]) for j in jobs)
    assert metrics["specserve_verifier_batch_size_sum"] > metrics["specserve_verifier_steps_total"]
    drafted, accepted = drafted_and_accepted(cluster)
    assert (drafted > accepted) if speculative else (drafted == 0)


@pytest.mark.cluster
def test_a_flood_runs_in_a_tight_kv_pool_and_what_can_never_fit_is_rejected(cluster_of, tokenizer):
    """A 336-token pool (21 blocks) holds the worst case (prompt + max_tokens) of three of these
    requests, but admission takes only a prompt's blocks: four run at once (the batch size), and
    when their growth runs the pool dry the verifier preempts and recomputes. Every request
    completes, identical to the others."""
    budget = 336
    cluster, stub = cluster_of(verifier={"kv_budget_tokens": budget, "batch_size": 4})
    ids = tokenizer("def add(a, b):\n    return a + b\n" * 2).input_ids
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request(prompt_ids=ids, max_tokens=budget), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "KV cache" in err.value.details() and "lower max_tokens" in err.value.details()

    need = len(ids) + 80  # the worst case of three fits, not four
    assert 3 * need <= budget < 4 * need
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(verifier_status(cluster))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with cf.ThreadPoolExecutor(12) as pool:
            results = list(
                pool.map(
                    lambda i: generate(stub, request(prompt_ids=ids, max_tokens=80)), range(12)
                )
            )
    finally:
        done.set()
        watcher.join()
    assert all(len(r.ids) == 80 for r in results)
    assert len({tuple(r.ids) for r in results}) == 1
    assert max(s.running for s in seen) == 4
    assert all(s.kv_used <= s.kv_budget == budget for s in seen)
    assert cluster.procs["verifier"].popen.poll() is None

    # Past the gateway (straight to the scheduler): it fails at once instead of blocking
    # the requests queued behind it.
    with grpc.insecure_channel(cluster.procs["scheduler"].address) as channel:
        scheduler_pb2_grpc.SchedulerServiceStub(channel).Submit(
            scheduler_pb2.SubmitRequest(
                request_id="too-big",
                prompt_ids=ids,
                max_tokens=budget,
                priority=common_pb2.PRIORITY_CLASS_INTERACTIVE,
            ),
            timeout=10,
        )
    res = generate(stub, request(prompt_ids=ids, max_tokens=10))
    assert len(res.ids) == 10
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    failed = lambda: r.hget(req_key("too-big"), "status") == "failed"  # noqa: E731
    wait_until(failed, "the request that can never fit failed", 30)
    assert "more than any verifier has" in r.hget(req_key("too-big"), "final")


@pytest.mark.cluster
def test_an_interactive_request_starts_within_a_few_steps_behind_a_full_batch_queue(
    cluster_of, tokenizer
):
    cluster, stub = cluster_of(
        verifier={"batch_size": 3, "interactive_reserved_slots": 1},
        scheduler={"batch_queue_limit": 8},
        gateway={"max_tokens_limit": 2000},
    )
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    ids = tokenizer("import os\n").input_ids
    long = request(prompt_ids=ids, max_tokens=2000, priority=BATCH)
    batch = [stub.Generate(long, timeout=120) for _ in range(2)]
    for call in batch:
        next(call)  # both batch slots are busy
    batch += [stub.Generate(long, timeout=120) for _ in range(8)]
    deadline = time.monotonic() + 30
    while r.get(queued_key("batch")) != "8":
        assert time.monotonic() < deadline, "the batch work did not queue up"
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as err:  # the batch queue is full
        list(stub.Generate(request(prompt_ids=ids, max_tokens=5, priority=BATCH), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    before = verifier_status(cluster).steps
    stream = stub.Generate(request(prompt_ids=ids, max_tokens=5), timeout=60)
    next(stream)
    waited = verifier_status(cluster).steps - before
    list(stream)
    # The batch requests run 2000 steps each: without the reserved slot this waits that long.
    print(f"interactive first token after {waited} verifier steps behind a full batch queue")
    assert waited < 200, f"the interactive request waited {waited} steps"
    assert int(r.get(queued_key("batch"))) >= 6  # it went first
    for call in batch:
        call.cancel()


@pytest.mark.cluster
def test_waiting_batch_work_is_placed_after_a_bounded_run_of_interactive_work(
    cluster_of, tokenizer
):
    cluster, stub = cluster_of(
        verifier={"batch_size": 1, "interactive_reserved_slots": 0},
        scheduler={"interactive_burst": 2},
    )
    ids = tokenizer("x = 1\n").input_ids
    first = stub.Generate(request(prompt_ids=ids, max_tokens=1000, request_id="i0"), timeout=120)
    next(first)  # the one slot is busy until i0 is cancelled; what follows waits
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)

    def queued(cls: str, n: int) -> None:
        wait_until(lambda: r.get(queued_key(cls)) == str(n), f"{n} queued {cls} requests")

    later = [
        stub.Generate(request(prompt_ids=ids, max_tokens=10, request_id=f"i{n}"), timeout=120)
        for n in range(1, 7)
    ]
    queued("interactive", 6)
    batch = stub.Generate(
        request(prompt_ids=ids, max_tokens=10, request_id="b", priority=BATCH), timeout=120
    )
    queued("batch", 1)
    more = [
        stub.Generate(request(prompt_ids=ids, max_tokens=10, request_id=f"j{n}"), timeout=120)
        for n in range(4)
    ]
    queued("interactive", 10)
    first.cancel()  # the slot frees with everything queued in the order it arrived
    for call in [*later, batch, *more]:
        list(call)
    admitted = {
        rid: int(r.hget(req_key(rid), "admitted_ms"))
        for rid in ["b", *(f"i{n}" for n in range(7)), *(f"j{n}" for n in range(4))]
    }
    order = sorted(admitted, key=admitted.get)
    # i0 was running; then at most `interactive_burst` (2) interactive ones before b.
    assert order.index("b") <= 3, order


class OneSlot:
    """A verifier with one slot, as the placement loop reaches it (`VerifierClients`): it admits
    into a free slot and refuses while a request runs; with `ends_on_refusal` that request
    ends just after a refusal (the slot frees in the middle of a placement pass)."""

    def __init__(self, store: RequestStore):
        self.store, self.running, self.admitted = store, False, []
        self.ends_on_refusal = False

    def get(self, address: str) -> OneSlot:
        return self

    def Admit(self, request, timeout=None, metadata=None) -> verifier_pb2.AdmitResponse:
        if self.running:
            self.running = not self.ends_on_refusal
            return verifier_pb2.AdmitResponse(admitted=False, reason="the batch is full")
        assert self.store.claim(request.request_id, "v1", now_ms()) == 1
        self.running = True
        self.admitted.append(request.request_id)
        return verifier_pb2.AdmitResponse(admitted=True)


def test_a_slot_that_frees_while_batch_is_refused_on_its_turn_goes_to_batch(redis_store):
    """The heartbeat shows the one slot free throughout (it is older than the admissions).
    After two interactive placements batch goes first; its Admit is refused, as the second
    still runs, which ends right then: the interactive request next in that pass must not take
    the slot (the verifier said it had none), so the batch request gets it at the next pass."""
    row = {"address": "127.0.0.1:9", "capacity": 1, "batch_capacity": 1, "kv_budget": 1000}
    redis_store.heartbeat("v1", row | {"kv_free": 1000, "block_size": 1, "max_seq_len": 100}, 30)
    for rid in ["i1", "i2", "i3", "b"]:
        cls = "batch" if rid == "b" else "interactive"
        redis_store.create(rid, {"prompt_ids": [1, 2], "max_tokens": 9}, cls, 10)
    verifier = OneSlot(redis_store)
    placer = Placer(SchedulerSettings(interactive_burst=2), redis_store, verifier, "test")
    assert placer.place_some()  # i1
    verifier.running = False  # i1 ended
    assert placer.place_some()  # i2: two interactive placements in a row while b waited
    verifier.ends_on_refusal = True  # i2 ends just after refusing the next Admit (b's)
    placer.place_some()
    placer.place_some()
    assert verifier.admitted == ["i1", "i2", "b"]


@SPECULATION
@pytest.mark.cluster
def test_a_shared_prefix_is_placed_where_its_blocks_are_cached_and_reused(
    cluster_of, tiny_model, tokenizer, speculative
):
    """Two verifiers; a conversation's second turn goes to the one holding the first turn's
    blocks even when it is the busier one, and reuses every full block of them. A request with
    the same prompt and no session reuses them as well (automatic prefix caching)."""
    cluster, stub = cluster_of(speculative=speculative)
    cluster.start_service("verifier", instance="verifier2")
    cluster.wait_ready("verifier2", 120)
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    wait_until(lambda: len(r.smembers("specserve:verifiers")) == 2, "two verifiers registered")
    turn1 = tokenizer("User: write a function that adds two numbers\nAssistant:").input_ids
    res1 = generate(stub, request(prompt_ids=turn1, max_tokens=24, session_id="chat-1"))
    owner = r.hget(req_key(res1.chunks[0].request_id), "owner")
    assert res1.final.usage.cached_prompt_tokens == 0

    # Load the session's verifier, so that least-loaded placement alone would go elsewhere;
    # once the registry shows both idle (the first turn's reservation gone from its beat).
    def idle() -> bool:
        rows = RequestStore.from_url(cluster.redis_url).live_verifiers()
        return len(rows) == 2 and all(v["running"] == v["kv_used"] == "0" for v in rows)

    wait_until(idle, "both verifiers idle in the registry")
    busy = stub.Generate(request(prompt_ids=turn1, max_tokens=1000, request_id="busy"), timeout=120)
    next(busy)
    assert r.hget(req_key("busy"), "owner") == owner  # idle verifiers tie: the first again
    turn2 = turn1 + res1.ids + tokenizer("\nUser: now three numbers\nAssistant:").input_ids
    res2 = generate(stub, request(prompt_ids=turn2, max_tokens=24, session_id="chat-1"))
    rid2 = res2.chunks[0].request_id
    assert r.hget(req_key(rid2), "owner") == owner
    # Every full block the first turn computed (its prompt and all but its last token; "busy",
    # the same greedy prompt, may have computed that last one too by now).
    done = len(turn1) + len(res1.ids)
    assert res2.final.usage.cached_prompt_tokens in {(done - 1) // 16 * 16, done // 16 * 16}
    assert res2.ids == hf_greedy(tiny_model, turn2, 24)
    busy.cancel()

    alone = generate(stub, request(prompt_ids=turn2, max_tokens=24))
    assert r.hget(req_key(alone.chunks[0].request_id), "owner") == owner
    assert alone.final.usage.cached_prompt_tokens == (len(turn2) - 1) // 16 * 16
    assert alone.ids == res2.ids
    drafted = sum(r.final.speculation.drafted_tokens for r in (res1, res2, alone))
    accepted = sum(r.final.speculation.accepted_tokens for r in (res1, res2, alone))
    assert (drafted > accepted) if speculative else (drafted == 0)


@pytest.mark.cluster
def test_the_result_cache_replays_deterministic_requests_only(gateway, tokenizer):
    ids = tokenizer("for i in range(10):").input_ids
    greedy = request(prompt_ids=ids, max_tokens=12, use_result_cache=True, stop=["\n\n"])
    plain, again = generate(gateway, greedy), generate(gateway, greedy)
    assert not plain.final.cached and again.final.cached
    assert (again.ids, again.text) == (plain.ids, plain.text)
    assert again.final.usage == plain.final.usage
    assert again.final.finish_reason == plain.final.finish_reason
    not_opted = generate(gateway, request(prompt_ids=ids, max_tokens=12, stop=["\n\n"]))
    assert not not_opted.final.cached and not_opted.ids == plain.ids

    unseeded = common_pb2.SamplingParams(temperature=1.0)
    req = request(prompt_ids=ids, max_tokens=12, use_result_cache=True, sampling=unseeded)
    assert not any(generate(gateway, req).final.cached for _ in range(2))
    seeded = common_pb2.SamplingParams(temperature=1.0, seed=5)
    req = request(prompt_ids=ids, max_tokens=12, use_result_cache=True, sampling=seeded)
    first, again = generate(gateway, req), generate(gateway, req)
    assert again.final.cached and again.ids == first.ids
