"""The verifier's drafter sync (what changed goes to the drafter) and its local fallback."""

from __future__ import annotations

from specserve.common.settings import VerifierSettings


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
    speculator = Speculator(settings.speculation, settings.batch, vocab_size=1000)
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
