"""The verifier's Engine itself, step by step, against a real private Redis and the tiny model:

- a failure in a step (forward pass, non-finite logits, acceptance) ends only the sequence it
  belongs to, with FINISH_REASON_ERROR and a message, its slot and reservation freed, while the
  rest of the batch stays token-identical to Hugging Face `generate`;
- steps that fail for everyone turn health NOT_SERVING; nothing retries forever;
- EOS, a stop string and max_tokens that land inside an accepted draft prefix end the output
  exactly where `generate` ends it.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from conftest import DEVICE
from helpers import make_sequence, wait_until
from specserve.engine import models
from specserve.engine.flat_model import FlatModel
from specserve.speculation import acceptance as acceptance_module
from specserve.speculation.draft_model import DraftModelProposer
from specserve.speculation.proposer import DraftJob, TreeShape
from specserve.speculation.sampling import SamplingParams
from specserve.store import RequestStore
from specserve.verifier import engine as engine_module
from specserve.verifier.admission import Admission
from specserve.verifier.engine import Engine, engine_settings
from specserve.verifier.reference import hf_greedy
from specserve.verifier.runner import ModelRunner
from specserve.verifier.writes import Owner

VID = "verifier-under-test"
PROMPTS = [[9707, 11, 1879, 0, 9707], [750, 75698, 1445, 982], [1, 2, 3, 4, 5, 1, 2]]
POISON = 4242  # a token whose embedding is inf: every logit after it is NaN


@pytest.fixture
def store(redis_store):
    return redis_store


@pytest.fixture(scope="module")
def poisoned(tiny_model_dir):
    """The tiny target with an untied LM head and one input embedding set to inf: a model that
    overflows on one input, as float16 does on some."""
    model = models.load_model(tiny_model_dir, DEVICE, "float32")
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.model.embed_tokens.weight[POISON] = float("inf")
    return model


class TargetDrafts:
    """The Engine's speculator, drafting chains of `depth` with the target itself, so every
    draft is accepted and the output ends inside an accepted prefix."""

    def __init__(self, model, depth: int):
        self.proposer = DraftModelProposer(
            FlatModel(model), TreeShape(max_depth=depth, branching=1, width=1)
        )
        self.depth = depth

    def propose(self, seqs, other_tokens=0, first_token=False):
        jobs = [DraftJob(s.request_id, s.all_ids, 0 if s.prefilling else self.depth) for s in seqs]
        return self.proposer.propose(jobs)

    def observe_step(self, *args) -> None:
        pass

    def observe_acceptance(self, seq, tree, accepted: list[int], tested: int) -> None:
        seq.tested += tested

    def forget(self, seq) -> None:
        self.proposer.forget(seq.request_id)


class NoDrafts(TargetDrafts):
    def __init__(self):
        pass

    def propose(self, seqs, other_tokens=0, first_token=False):
        from specserve.speculation.tree import DraftTree

        return [DraftTree() for _ in seqs]

    def forget(self, seq) -> None:
        pass


def make_engine(
    model,
    store,
    speculator=None,
    eos_ids=(),
    decode=None,
    kv_tokens=8192,
    block_size=16,
    async_writes=False,
) -> Engine:
    flat = FlatModel(model)
    pool = flat.use_pool(kv_tokens, block_size, fixed=True)
    return Engine(
        ModelRunner(flat),
        speculator or NoDrafts(),
        store,
        Admission(pool, batch_size=8, interactive_reserved_slots=0),
        **engine_settings(
            max_seq_len=2048,
            max_prefill_tokens=512,
            max_unread_tokens=0,
            async_step_writes=async_writes,
        ),
        owner=Owner(verifier_id=VID),
        eos_ids=set(eos_ids),
        decode=decode or (lambda ids: ""),
    )


def admit(engine: Engine, store: RequestStore, rid: str, prompt, max_tokens=12, **kw):
    """Creates, claims and admits a request, as the scheduler and VerifierService.Admit do."""
    store.create(rid, {"prompt_ids": prompt, "max_tokens": max_tokens}, "interactive", 100)
    assert store.claim(rid, VID, int(time.time() * 1000)) == 1
    seq = make_sequence(prompt, max_tokens=max_tokens, rid=rid)
    for name, value in kw.items():
        setattr(seq, name, value)
    grant = engine.admission.admit(rid, seq.queue, prompt)
    engine.admit(seq, grant)
    return seq


def run(engine: Engine, limit: int = 200) -> int:
    """Steps the engine until nothing runs; returns the steps taken."""
    engine._take_new(block=False)
    for steps in range(1, limit + 1):
        engine.step()
        if not engine.running:
            return steps
    raise AssertionError(f"still running after {limit} steps")


def final_of(store: RequestStore, rid: str) -> dict:
    last = store.r.xrevrange(f"specserve:out:{rid}", count=1)
    assert last and "final" in last[0][1], f"{rid} has no final entry"
    return json.loads(last[0][1]["final"])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_non_finite_logits_end_only_their_sequence(poisoned, store, sampled):
    engine = make_engine(poisoned, store)
    seqs = [admit(engine, store, f"ok{i}", p) for i, p in enumerate(PROMPTS)]
    bad = admit(engine, store, "bad", [5, 6, POISON, 7], max_tokens=12)
    if sampled:  # sampling from NaN probabilities raised, and the step was retried forever
        bad.params = SamplingParams(temperature=1.0, seed=1)
    run(engine)
    assert bad.finish_reason == "FINISH_REASON_ERROR" and bad.output_ids == []
    assert "not finite" in bad.error
    final = final_of(store, "bad")
    assert final["finish_reason"] == "FINISH_REASON_ERROR" and "not finite" in final["error"]
    assert store.get("bad").status == "failed"
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.output_ids == hf_greedy(poisoned, prompt, 12), seq.request_id
        assert store.get(seq.request_id).status == "finished"
    assert engine.admission.load()["running"] == 0  # every slot and reservation went back
    assert engine.healthy()


@pytest.mark.skipif(
    DEVICE != "cpu",
    reason="on CUDA a token past the embedding table is a device-side assert, which ends the "
    "process's CUDA context rather than one pass (the gateway refuses such tokens)",
)
def test_a_failing_forward_pass_is_attributed_to_its_sequence(tiny_model, store):
    engine = make_engine(tiny_model, store)
    seqs = [admit(engine, store, f"ok{i}", p) for i, p in enumerate(PROMPTS)]
    vocab = tiny_model.config.vocab_size
    bad = admit(engine, store, "bad", [5, vocab + 7, 6])  # past the embedding table
    steps = run(engine)
    assert bad.finish_reason == "FINISH_REASON_ERROR"
    assert "forward pass failed" in final_of(store, "bad")["error"]
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.output_ids == hf_greedy(tiny_model, prompt, 12)
    assert steps == 12  # the others were not held back: 1 prefill step + 11 decode steps
    assert engine.admission.load()["running"] == 0 and engine.healthy()


def test_a_failure_in_acceptance_rewinds_and_ends_only_its_sequence(tiny_model, store, monkeypatch):
    """Selection fails for the batch holding the marked sequence and for it alone: the others
    are selected one by one and go on."""
    real_select = acceptance_module.select
    calls = {"bad": 0, "before": -1}
    held = {}

    def failing_select(batch):
        if any(c.params.top_k == 7 for c in batch):  # marks the sequence to fail, at its 4th step
            calls["bad"] += 1
            if calls["bad"] >= 4:
                calls["before"] = len(held["bad"].output_ids)
                calls.setdefault("failed batch", len(batch))
                raise RuntimeError("acceptance broke")
        return real_select(batch)

    monkeypatch.setattr(acceptance_module, "select", failing_select)
    engine = make_engine(tiny_model, store, TargetDrafts(tiny_model, depth=3))
    seqs = [admit(engine, store, f"ok{i}", p, max_tokens=20) for i, p in enumerate(PROMPTS)]
    bad = admit(engine, store, "bad", [8, 9, 10, 11], max_tokens=40)
    bad.params = SamplingParams(top_k=7)  # greedy still; top_k only marks it
    held["bad"] = bad
    run(engine)
    assert bad.finish_reason == "FINISH_REASON_ERROR" and "acceptance broke" in bad.error
    # the prompt's step (1 token), two steps of 3 accepted drafts + 1, nothing of the fourth
    assert calls["before"] == len(bad.output_ids) == 9
    assert calls["failed batch"] == 1 + len(PROMPTS)  # the others were in it, and went on
    assert bad.output_ids == hf_greedy(tiny_model, [8, 9, 10, 11], 40)[:9]
    assert store.progress("bad") == bad.output_ids
    assert bad.kv is None  # released
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.output_ids == hf_greedy(tiny_model, prompt, 20)
        assert seq.accepted > 0
    assert engine.admission.load()["running"] == 0


def test_async_step_writes_stream_the_same_and_end_a_step_later(tiny_model, store):
    """Each step's tokens travel to Redis while the next step computes: the output streams
    and their ends are those of writes the step waits for, the batch empties one step later,
    and a cancel still ends its request (a step later too)."""
    seen, steps = {}, {}
    for async_writes in (False, True):
        engine = make_engine(tiny_model, store, async_writes=async_writes)
        rids = [f"w{int(async_writes)}-{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(rids, PROMPTS, strict=True):
            admit(engine, store, rid, prompt)
        steps[async_writes] = run(engine)
        finals = [final_of(store, rid) for rid in rids]
        seen[async_writes] = [
            (store.progress(rid), f["finish_reason"], f["usage"]["completion_tokens"])
            for rid, f in zip(rids, finals, strict=True)
        ]
        assert all(store.get(rid).status == "finished" for rid in rids)
    assert seen[True] == seen[False]
    for (ids, *_), prompt in zip(seen[True], PROMPTS, strict=True):
        assert ids == hf_greedy(tiny_model, prompt, 12)
    assert steps[True] == steps[False] + 1

    engine = make_engine(tiny_model, store, async_writes=True)
    seq = admit(engine, store, "w-cancel", PROMPTS[0], max_tokens=40)
    engine._take_new(block=False)
    for _ in range(3):
        engine.step()
    engine.cancel("w-cancel")
    run(engine)
    assert store.get("w-cancel").status == "cancelled"
    assert len(store.progress("w-cancel")) == len(seq.output_ids) < 40


def test_a_temperature_near_zero_is_greedy(tiny_model, store):
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=9e-4, seed=3).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    engine = make_engine(tiny_model, store)
    seq = admit(engine, store, "cold", PROMPTS[0])
    seq.params = SamplingParams(temperature=1e-40, seed=5)
    run(engine)
    assert seq.finish_reason == "FINISH_REASON_LENGTH"
    assert seq.output_ids == hf_greedy(tiny_model, PROMPTS[0], 12)


def test_steps_that_fail_for_everyone_turn_health_off_and_end_their_requests(
    tiny_model, store, monkeypatch
):
    engine = make_engine(tiny_model, store)

    def broken(seqs, trees, takes=None):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "verify", broken)
    engine.start()
    try:
        for i in range(engine.max_failed_steps):
            admit(engine, store, f"r{i}", PROMPTS[0])
            wait_until(lambda i=i: store.get(f"r{i}").status == "failed", f"r{i} failed")
            assert "device lost" in final_of(store, f"r{i}")["error"]
        wait_until(lambda: not engine.healthy(), "health off")
        monkeypatch.undo()  # the device is back: the next good step turns health on
        admit(engine, store, "after", PROMPTS[1])
        wait_until(lambda: store.get("after").status == "finished", "the request after", 60)
        assert engine.healthy()
    finally:
        engine.stop()


def test_a_redis_outage_pauses_the_loop_with_one_line_each_way(tiny_model, redis_server, caplog):
    store = RequestStore.from_url(redis_server.redis_url, retries=3)  # fails in ~0.4 s, not ~6
    store.ensure_queues()
    engine = make_engine(tiny_model, store)
    engine.start()
    try:
        seq = admit(engine, store, "through", PROMPTS[0], max_tokens=400)
        wait_until(lambda: store.get("through").generated > 0, "tokens written", 60)
        redis_server.kill_redis()
        wait_until(lambda: "redis unreachable" in caplog.text, "the loop noticed", 60)
        redis_server.start_redis()  # (with AOF: nothing written is lost)
        wait_until(lambda: store.get("through").status == "finished", "finished", 300)
    finally:
        engine.stop()
    assert store.progress("through") == seq.output_ids == hf_greedy(tiny_model, PROMPTS[0], 400)
    lines = [r for r in caplog.records if r.name == engine_module.__name__]
    assert sum("redis unreachable" in r.getMessage() for r in lines) == 1
    assert sum("redis back after" in r.getMessage() for r in lines) == 1
    assert not any(r.exc_info for r in lines)
    assert engine.healthy()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return hf_greedy(tiny_model, PROMPTS[1], 30)


def new_token_at(reference: list[int]) -> int:
    """The first index past 1 whose token did not come before: with chains of 6, the prompt's
    step emits token 0 and the next step tokens 1..7, so it lies inside that step's chain."""
    found = [i for i in range(2, 7) if reference[i] not in reference[:i]]
    assert found, f"the tiny model's output has no new token among its first 7: {reference}"
    return found[0]


def test_eos_inside_an_accepted_prefix(tiny_model, store, reference):
    first = new_token_at(reference)
    eos = reference[first]
    engine = make_engine(tiny_model, store, TargetDrafts(tiny_model, depth=6), eos_ids=[eos])
    seq = admit(engine, store, "eos", PROMPTS[1], max_tokens=30)
    steps = run(engine)
    expected = hf_greedy(tiny_model, PROMPTS[1], 30, eos_token_id=eos)
    assert seq.output_ids == expected == reference[: first + 1]
    assert seq.finish_reason == "FINISH_REASON_EOS"
    assert steps == 2  # the prompt's step gave token 0; the next step's chain held the EOS
    assert store.progress("eos") == expected


def test_a_stop_string_inside_an_accepted_prefix(tiny_model, tokenizer, store, reference):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    first = new_token_at(reference)
    stop = decode(reference[: first + 1])[-2:]  # ends with the new token's text
    assert stop not in decode(reference[:first])
    engine = make_engine(tiny_model, store, TargetDrafts(tiny_model, depth=6), decode=decode)
    seq = admit(engine, store, "stop", PROMPTS[1], max_tokens=30, stop=[stop])
    run(engine)
    expected = hf_greedy(tiny_model, PROMPTS[1], 30, stop_strings=[stop], tokenizer=tokenizer)
    assert seq.finish_reason == "FINISH_REASON_STOP"
    assert seq.output_ids == expected == reference[: first + 1]


@pytest.mark.parametrize("max_tokens", [1, 4, 9])
def test_max_tokens_inside_an_accepted_prefix(tiny_model, store, reference, max_tokens):
    engine = make_engine(tiny_model, store, TargetDrafts(tiny_model, depth=6))
    seq = admit(engine, store, f"len{max_tokens}", PROMPTS[1], max_tokens=max_tokens)
    run(engine)
    assert seq.finish_reason == "FINISH_REASON_LENGTH"
    assert seq.output_ids == reference[:max_tokens]
    assert store.progress(f"len{max_tokens}") == reference[:max_tokens]


def test_preempted_sequences_resume_with_the_same_tokens(tiny_model, store):
    """Three sequences outgrow a 16-block pool: the step drops its drafts, then preempts, and
    the preempted come back recomputed. Every output is still token-identical to `generate`,
    with no index missing or repeated in what was written; the finals count the preemptions;
    every block is back at the end."""
    engine = make_engine(
        tiny_model, store, TargetDrafts(tiny_model, depth=3), kv_tokens=64, block_size=4
    )
    seqs = [admit(engine, store, f"p{i}", p, max_tokens=30) for i, p in enumerate(PROMPTS)]
    seqs[2].queue = "batch"
    run(engine)
    finals = {s.request_id: final_of(store, s.request_id) for s in seqs}
    for seq, prompt in zip(seqs, PROMPTS, strict=True):
        assert seq.output_ids == hf_greedy(tiny_model, prompt, 30), seq.request_id
        assert store.progress(seq.request_id) == seq.output_ids
        assert finals[seq.request_id]["usage"]["preemptions"] == seq.preemptions
    assert sum(s.preemptions for s in seqs) > 0
    assert seqs[2].preemptions >= max(s.preemptions for s in seqs[:2])  # batch class first
    pool = engine.runner.model.pool
    assert pool.available == pool.blocks and engine.admission.resuming == 0


def test_a_sampled_sequence_draws_the_same_tokens_through_preemption(tiny_model, store):
    outputs = []
    for kv_tokens in (4096, 48):
        engine = make_engine(tiny_model, store, kv_tokens=kv_tokens, block_size=4)
        seqs = [
            admit(engine, store, f"s{kv_tokens}-{i}", p, max_tokens=25)
            for i, p in enumerate(PROMPTS)
        ]
        for i, seq in enumerate(seqs):
            seq.params = SamplingParams(temperature=1.0, seed=i)
            seq.generator = torch.Generator(DEVICE).manual_seed(i)  # where the logits are
        run(engine)
        outputs.append(([s.output_ids for s in seqs], sum(s.preemptions for s in seqs)))
    assert outputs[0][1] == 0 and outputs[1][1] > 0
    assert outputs[1][0] == outputs[0][0]


def test_a_prompt_sharing_a_prefix_reuses_its_blocks_without_a_session(tiny_model, store):
    engine = make_engine(tiny_model, store, block_size=4)
    system = [(7 * i) % 500 + 3 for i in range(41)]
    first = admit(engine, store, "first", system + [11, 12], max_tokens=8)
    run(engine)
    second = admit(engine, store, "second", system + [13], max_tokens=8)
    third = admit(engine, store, "third", system[:20] + [14, 15], max_tokens=8)
    run(engine)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 40 and third.cached_tokens == 20
    for seq in (first, second, third):
        assert seq.output_ids == hf_greedy(tiny_model, seq.prompt_ids, 8), seq.request_id
    assert final_of(store, "second")["usage"]["cached_prompt_tokens"] == 40
