"""benchmarks.llamacpp --rounds: a row's figures are its median over rounds, and the targets'
ratios are taken within each round (rows of one round ran minutes apart; rounds, further)."""

from __future__ import annotations

import pytest

from benchmarks import llamacpp

ON, OFF = "specserve default, speculation on", "specserve default, speculation off"


def _round(on: float, off: float, plain: float, ngram: float) -> dict:
    def row(rate: float) -> dict:
        return {
            "decode_tokens_per_s": rate,
            "ttft_ms": 100 * rate,
            "tokens": 128,
            "target_version": "a",
        }

    return {
        ON: {"code": row(on) | {"mean_accepted_length": 1.5}},
        OFF: {"code": row(off)},
        "llama.cpp plain": {"code": row(plain)},
        "llama.cpp n-gram (ngram-simple)": {"code": row(ngram)},
    }


def test_rows_take_the_median_and_ratios_pair_rows_of_one_round():
    # The second round ran on a machine twice as slow: every row halves, no ratio moves.
    rounds = [_round(30, 25, 20, 24), _round(15, 12.5, 10, 12), _round(33, 30, 22, 20)]
    rows = llamacpp.medians(rounds)
    assert rows[ON]["code"]["decode_tokens_per_s"] == 30
    assert rows[ON]["code"]["decode_tokens_per_s_by_round"] == [30, 15, 33]
    assert rows[ON]["code"]["mean_accepted_length"] == 1.5
    assert rows["llama.cpp plain"]["code"]["ttft_ms"] == 2000
    assert rows[ON]["code"]["tokens"] == 128  # (the same in every round: kept as it was)
    # A field that is not a timing and differs between rounds is kept round by round.
    rounds[1][ON]["code"]["target_version"] = "b"
    assert llamacpp.medians(rounds)[ON]["code"]["target_version_by_round"] == ["a", "b", "a"]

    ratios = llamacpp.ratios(rounds)
    on_off = ratios["specserve on / off"]["code"]
    assert on_off["by_round"] == [1.2, 1.2, 1.1]
    assert on_off["median"] == 1.2 and on_off["min"] == 1.1
    assert ratios["specserve on / llama.cpp plain"]["code"]["by_round"] == [1.5, 1.5, 1.5]
    # The fastest speculative llama.cpp row of each round: n-gram in the first two, and in
    # the third its plain row is faster but is not speculative, so n-gram still.
    best = ratios["specserve on / llama.cpp best speculative"]["code"]["by_round"]
    assert best == pytest.approx([30 / 24, 15 / 12, 33 / 20], abs=1e-3)


def test_ratios_leave_out_rows_a_run_did_not_have():
    only_specserve = [{ON: _round(30, 25, 20, 24)[ON], OFF: _round(30, 25, 20, 24)[OFF]}]
    ratios = llamacpp.ratios(only_specserve)
    assert list(ratios) == ["specserve on / off"]
    assert ratios["specserve on / off"]["code"]["by_round"] == [1.2]
