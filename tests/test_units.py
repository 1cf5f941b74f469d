"""Pure parts: detokenization, stop trimming, sampling, validation, settings."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specserve.common.settings import ConfigError, DrafterSettings, VerifierSettings
from specserve.gateway.tails import Tail, Tails
from specserve.gateway.text import IncrementalDetokenizer, StopTrimmer
from specserve.speculation.sampling import SamplingParams, target_probs
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port


def test_incremental_detokenizer_never_splits_characters(tokenizer):
    text = "naïve café — 你好，世界! 🙂🚀 done"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t, skip_special_tokens=True))
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["Hello wor", "ld. Bye"], ["world"], "Hello "),
        (["ab", "c", "STO", "P tail"], ["STOP"], "abc"),
        (["no stop here"], ["STOP"], "no stop here"),
        (["x", "yz"], [], "xyz"),
    ],
)
def test_stop_trimmer(pieces, stops, expected):
    trimmer = StopTrimmer(stops)
    out = "".join(trimmer.push(p) for p in pieces) + trimmer.flush()
    assert out == expected


def test_a_stream_cut_as_its_next_batch_arrives_is_still_cut():
    """A drain cancels the streams it cuts; a batch that arrived in the same loop turn must
    not swallow the cancel (asyncio.wait_for on Python 3.11 does), or the stream runs on."""

    async def cut_as_a_batch_arrives() -> str:
        tail = Tail("r", "out:r", "0-0")
        reading = asyncio.create_task(tail.get())
        await asyncio.sleep(0)  # one loop turn: the task runs until it waits
        assert tail._waiter is not None  # (it is waiting for a batch)
        tail.put([("1-0", {"first": "0", "ids": "7"})])
        reading.cancel()  # (in the same turn: neither has run since)
        try:
            return f"returned {await reading}"
        except asyncio.CancelledError:
            return f"cut, {len(tail.backlog)} batch left"

    assert asyncio.run(cut_as_a_batch_arrives()) == "cut, 1 batch left"


def test_a_waiting_stream_is_woken_when_its_reads_fail():
    """A stream waits on no timer: its reader wakes it when reads fail, for it to see how
    long Redis has been gone (and give up after its limit)."""

    async def wait_with_redis_gone() -> tuple[object, float]:
        # Nothing there; a short retry window (services use about 6 s).
        store = RequestStore.from_url(f"redis://127.0.0.1:{free_port()}/0", retries=3)
        tails = Tails(store, asyncio.get_running_loop())
        try:
            tail = tails.open("r")
            async with asyncio.timeout(30):
                got = await tail.get()
            return got, tail.outage_seconds()
        finally:
            tails.stop()

    got, outage = asyncio.run(wait_with_redis_gone())
    assert got is None and outage > 0


def test_top_k_and_top_p_restrict_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_settings_yaml_env_and_errors(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("common: {log_level: DEBUG}\nverifier: {batch_size: 3, dtype: bfloat16}\n")
    s = VerifierSettings.load(path)
    assert (s.batch_size, s.dtype, s.log_level) == (3, "bfloat16", "DEBUG")
    monkeypatch.setenv("SPECSERVE_VERIFIER_BATCH_SIZE", "5")
    assert VerifierSettings.load(path).batch_size == 5
    monkeypatch.setenv("SPECSERVE_VERIFIER_BATCH_SIZE", "0")
    with pytest.raises(ConfigError, match="verifier.batch_size"):
        VerifierSettings.load(path)
    monkeypatch.delenv("SPECSERVE_VERIFIER_BATCH_SIZE")
    path.write_text("verifier: {bach_size: 3}\n")
    with pytest.raises(ConfigError, match="verifier.bach_size"):
        VerifierSettings.load(path)


def test_settings_refuse_a_device_this_build_cannot_run(tmp_path, monkeypatch):
    """A device torch cannot use here stops the service at start, naming the key; the same
    assertions hold on a machine with or without a GPU."""
    path = tmp_path / "c.yaml"
    path.write_text("verifier: {device: 'cuda:99'}\n")  # no machine shows 100 GPUs
    with pytest.raises(ConfigError, match=r"verifier\.device: .*cuda:99 cannot run here"):
        VerifierSettings.load(path)
    path.write_text("drafter: {device: gpu}\n")
    with pytest.raises(ConfigError, match=r"drafter\.device: .*pattern"):
        DrafterSettings.load(path)
    monkeypatch.setenv("SPECSERVE_DRAFTER_DEVICE", "cuda")
    if torch.cuda.is_available():
        assert DrafterSettings.load(None).device == "cuda"
        assert VerifierSettings.load(None, device="cuda:0").device == "cuda:0"
    else:
        with pytest.raises(ConfigError, match=r"drafter\.device: .*cuda cannot run here.*torch"):
            DrafterSettings.load(None)
    assert VerifierSettings.load(None, device="cpu").device == "cpu"


def test_circuit_breaker_opens_after_failures_and_retries_after_cooldown():
    from specserve.verifier.breaker import CircuitBreaker

    now = [100.0]
    breaker = CircuitBreaker(failures=2, cooldown=5.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    now[0] += 5.0
    assert breaker.allow()  # half-open: one trial
    breaker.failure()
    assert not breaker.allow()  # the trial failed: open again
    now[0] += 5.0
    breaker.success()
    assert breaker.allow() and breaker.failures == 0


def test_drafter_sync_sends_what_changed_and_tells_a_drafter_what_left_it():
    from helpers import make_sequence
    from specserve.verifier.drafter_client import DrafterClient
    from specserve.verifier.drafter_sync import DrafterSync

    a, b = DrafterClient("a:1"), DrafterClient("b:1")
    sync, seq = DrafterSync(), make_sequence([1, 2, 3], rid="s")
    seq.tenant = "acme"

    def sent(client: DrafterClient, seqs=(seq,)) -> list[tuple]:
        sync.next_step()
        request = sync.request(client, list(seqs), [(4, 8)] * len(seqs), drafters={"a:1", "b:1"})
        for d in request.sequences:
            if not d.finished:
                assert (d.budget, d.deep_budget) == (4, 8)
                # who the sequence is comes with its first message (or a resend)
                assert (d.tenant, d.prompt_len) == (("acme", 3) if d.accepted_len == 0 else ("", 0))
        assert request.step == sync.step
        return [
            (d.sequence_id, list(d.new_token_ids), d.accepted_len, d.finished)
            for d in request.sequences
        ]

    assert sent(a) == [("s", [1, 2, 3], 0, False)]
    seq.output_ids += [4, 5]
    assert sent(a) == [("s", [4, 5], 3, False)]  # only the new tokens
    assert sync.largest_delta == 2
    a.epoch += 1  # a new stream: the drafter behind it holds nothing
    assert sent(a) == [("s", [1, 2, 3, 4, 5], 0, False)]
    sync.resynced(["s"])  # the drafter lost it
    assert sent(a) == [("s", [1, 2, 3, 4, 5], 0, False)]
    assert sent(b) == [("s", [1, 2, 3, 4, 5], 0, False)]  # moved: b gets it all
    assert sync.drafters_to_tell() == ["a:1"]
    assert sent(a, seqs=()) == [("s", [], 0, True)]  # a forgets it
    seq.output_ids += [6, 7]
    sync.forget(seq, completed=True)  # it ended: b gets its last tokens, to learn the output
    assert sync.has_finished and sync.drafters_to_tell() == ["b:1"]
    assert sent(b, seqs=()) == [("s", [6, 7], 5, True)]
    assert not sync.has_finished


def test_fallback_drafts_locally_when_no_drafter_answers():
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.common.settings import VerifierSettings
    from specserve.verifier.speculator import Speculator

    settings = VerifierSettings.load(
        None,
        speculative_decoding=True,
        drafter_addresses=["127.0.0.1:1"],  # nothing listens there
        fallback_mode="ngram",
        verification_tree_size=4,
        speculation_policy="fixed",
        draft_timeout_seconds=2,
        breaker_failures=1,
        breaker_cooldown_seconds=60,
    )
    speculator = Speculator(settings, vocab_size=1000)
    seq = make_sequence([5, 6, 7, 8, 5, 6], output=[7])
    seq.kv = SimpleNamespace(length=6)  # past the prefill step: the prompt is cached
    try:
        (tree,) = speculator.propose([seq])
    finally:
        speculator.close()
    assert tree.token_ids == [8, 5, 6, 7]  # what followed the earliest "6, 7"
    assert seq.fallback_steps == 1
    # One failure opens the drafter's breaker (breaker_failures=1).
    assert not speculator.pool.breakers["127.0.0.1:1"].allow()


def test_budgets_pair_draft_model_and_model_free_caps_and_stay_adaptive_without_deep():
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.common.settings import VerifierSettings
    from specserve.verifier.speculator import Speculator

    def budgets(measured=True, node_seconds=0.2, **settings):
        speculator = Speculator(
            VerifierSettings.load(
                None, speculative_decoding=True, discover_drafters=False, **settings
            ),
            vocab_size=1000,
        )
        seqs = []
        for _ in range(3):
            seq = make_sequence([5, 6, 7], output=[8], max_tokens=200)
            seq.kv = SimpleNamespace(length=3)
            if measured:  # poor acceptance, measured over many drafts of either kind
                seq.drawn_tested = seq.free_tested = 100
                seq.drawn_accepted = seq.free_accepted = 30
            seqs.append(seq)
        policy = speculator.policy
        if policy is not None:  # (0.2 s: a big batch whose nodes cost more than they return)
            policy.steps = 1
            policy.cost.coef.a, policy.cost.coef.b = 0.1, node_seconds
            policy.cost.per_token_known = True
            policy.service_alpha = policy.service_free_alpha = 0.3
        return speculator.budgets(seqs)

    fixed = dict(speculation_policy="fixed", verification_tree_size=6, deep_tree_size=40)
    assert budgets(**fixed) == [(6, 40)] * 3
    adaptive = dict(speculation_policy="adaptive", verification_tree_size=6)
    assert budgets(**adaptive, deep_tree_size=0) == [(0, 0)] * 3  # the policy still decides
    assert budgets(**adaptive, deep_tree_size=64) == [(0, 0)] * 3
    # Not measured yet: priced as good drafts (EXPLORE_ALPHA) rather than by the service-wide
    # rate alone, they draft to find out where good drafts would pay, at the size they would
    # pay at; where nodes cost more than even good drafts return, they do not.
    assert budgets(False, **adaptive, deep_tree_size=64) == [(0, 0)] * 3
    cheap = budgets(False, 0.002, **adaptive, deep_tree_size=64)
    assert all(0 < k <= 6 and 0 < deep <= 64 for k, deep in cheap)
    assert budgets(False, 0.002, **adaptive, deep_tree_size=0) == [(k, 0) for k, _ in cheap]
    assert budgets(True, 0.002, **adaptive, deep_tree_size=64) != cheap  # (measured: poor)


def test_a_model_free_tree_explores_shallow_and_goes_deep_once_measured():
    """While a sequence's model-free trees are measured (EXPLORE_TREES of them), each is at
    most EXPLORE_DEPTH nodes: a rejection ends a tree at any depth, so a deep one tested no
    better and cost a 7-node pass each time; measured good, they go as deep as they pay."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.common.settings import VerifierSettings
    from specserve.verifier.speculator import EXPLORE_DEPTH, EXPLORE_TREES, Speculator

    speculator = Speculator(
        VerifierSettings.load(
            None, speculative_decoding=True, discover_drafters=False, deep_tree_size=64
        ),
        vocab_size=1000,
    )
    policy = speculator.policy
    policy.steps = 1
    policy.cost.coef.a, policy.cost.coef.b = 0.05, 0.002
    policy.cost.per_token_known = True
    seq = make_sequence([5, 6, 7], output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=3)
    seq.drawn_tested, seq.drawn_accepted = 100, 0  # (no draft-model trees: they never pass)
    ((_, exploring_deep),) = speculator.budgets([seq])
    seq.free_trees, seq.free_tested, seq.free_accepted = EXPLORE_TREES, 30, 29
    ((_, measured_deep),) = speculator.budgets([seq])
    assert 0 < exploring_deep <= EXPLORE_DEPTH < measured_deep


def test_a_draft_model_that_fell_behind_has_its_catch_up_priced():
    """Its draft model last grew the sequence a tree 150 tokens ago (plain steps since): on a
    probe step, which prices its drafts at EXPLORE_ALPHA, taking those tokens in first costs
    more than the exploring horizon can win back, so the draft model stays off; one step
    behind, the same probe drafts."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.common.settings import VerifierSettings
    from specserve.speculation.policy import PROBE_EVERY
    from specserve.verifier.speculator import Speculator

    speculator = Speculator(
        VerifierSettings.load(
            None, speculative_decoding=True, discover_drafters=False, deep_tree_size=0
        ),
        vocab_size=1000,
    )
    policy = speculator.policy
    policy.cost.coef.a, policy.cost.coef.b, policy.cost.coef.c = 0.05, 0.002, 0.01
    policy.cost.per_token_known = True
    policy.cost.observe_catch_up(100, 1.0)  # 10 ms a token
    seq = make_sequence(list(range(200)), output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=200)
    seq.drawn_tested, seq.drawn_accepted = 100, 10  # measured poor: only a probe drafts

    def probe(behind: int) -> int:
        seq.drawn_at = len(seq.all_ids) - behind
        policy.steps = PROBE_EVERY - 1  # (the next budgets call is a probe step)
        ((k, _),) = speculator.budgets([seq])
        return k

    assert probe(1) > 0
    assert probe(150) == 0
    policy.steps = 1
    assert speculator.budgets([seq]) == [(0, 0)]  # (and off a probe, poor drafts do not pay)


def test_a_pinned_tree_size_stays_within_the_operators_largest_tree():
    """A request may pin speculation.tree_size (up to 256 at the gateway); the verifier grows
    no tree past the larger of verification_tree_size and deep_tree_size for it, so one
    client cannot slow its batch-mates' steps with trees the operator never allowed."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.common.settings import VerifierSettings
    from specserve.verifier.speculator import Speculator

    settings = VerifierSettings.load(
        None,
        speculative_decoding=True,
        discover_drafters=False,
        verification_tree_size=6,
        deep_tree_size=40,
    )
    speculator = Speculator(settings, vocab_size=1000)
    seq = make_sequence([5, 6, 7], output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=3)
    for pinned, cap in ((256, 40), (20, 20), (3, 3)):
        seq.tree_size = pinned
        assert speculator.cap(seq) == speculator.cap(seq, settings.deep_tree_size) == cap


def test_a_model_free_tree_with_draft_distributions_is_dropped():
    from specserve.common.settings import VerifierSettings
    from specserve.speculation.tree import DraftTree, to_proto
    from specserve.v1 import drafter_pb2
    from specserve.verifier.speculator import Speculator

    speculator = Speculator(VerifierSettings.load(None), vocab_size=1000)
    tree = DraftTree(token_ids=[1, 2], parents=[-1, 0], model_free=True)
    msg = drafter_pb2.DraftTree()
    to_proto(tree, msg)
    assert len(speculator._checked(msg, (0, 2))) == 2  # a model-free tree: the deep budget
    assert len(speculator._checked(msg, (2, 1))) == 0  # over it
    tree.dists[-1] = ([1], [1.0])
    msg = drafter_pb2.DraftTree()
    to_proto(tree, msg)
    assert len(speculator._checked(msg, (8, 8))) == 0


def test_a_process_on_an_accelerator_takes_one_host_thread_unless_told():
    import torch

    from specserve.engine.models import ACCELERATOR_HOST_THREADS, set_host_threads

    before = torch.get_num_threads()
    try:
        set_host_threads(0, "cpu")
        assert torch.get_num_threads() == before  # torch's default
        set_host_threads(0, "cuda:0")
        assert torch.get_num_threads() == ACCELERATOR_HOST_THREADS
        set_host_threads(3, "cuda")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_model_starts_on_the_cpu_take_turns_on_a_host(tmp_path):
    """A second process's timing and load wait for the first's (a thread's own open of the
    lock file stands for it); a GPU process does not wait."""
    import threading

    from specserve.engine.models import cpu_start

    order = []

    def second():
        with cpu_start(tmp_path, "cpu", "drafter"):
            order.append("second")

    with cpu_start(tmp_path, "cpu", "verifier"):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive()  # waiting for the lock
        with cpu_start(tmp_path, "cuda:0", "verifier"):
            order.append("gpu")
        order.append("first")
    waiter.join(timeout=10)
    assert order == ["gpu", "first", "second"]
