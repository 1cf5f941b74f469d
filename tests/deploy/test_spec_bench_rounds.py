"""benchmarks.spec_bench --rounds: every figure is its median over rounds, and a speedup the
median of each round's own on over off (a round on a slower machine moves no speedup)."""

from __future__ import annotations

from benchmarks import spec_bench


def _modes(on: float, off: float, length: float = 1.0) -> dict:
    def mode(rate: float, accepted: float) -> dict:
        row = {"streams": 1, "questions": 1, "decode_tokens_per_s": rate, "ttft_ms": 500}
        return {
            "1": {
                "tokens_per_s_total": rate,
                "categories": {"coding": row | {"mean_accepted_length": accepted}},
                "target_version": "t",
            }
        }

    modes = {"on": mode(on, length), "off": mode(off, 1.0)}
    spec_bench.add_speedups(modes)
    return modes


def test_figures_are_medians_and_speedups_are_each_rounds_own():
    # The second round ran on a slower machine; the third drafted better.
    rounds = [_modes(10, 10), _modes(6, 4.8), _modes(20, 16, length=1.5)]
    merged = spec_bench.merge_rounds(rounds)
    coding = merged["on"]["1"]["categories"]["coding"]
    assert coding["decode_tokens_per_s"] == 10
    assert coding["decode_tokens_per_s_by_round"] == [10, 6, 20]
    assert coding["speedup_by_round"] == [1.0, 1.25, 1.25]
    # The median of the rounds' own ratios, not the ratio of the medians (10 / 10).
    assert coding["speedup"] == 1.25 and merged["on"]["1"]["speedup_total"] == 1.25
    assert coding["mean_accepted_length"] == 1.0
    assert coding["streams"] == 1 and merged["off"]["1"]["target_version"] == "t"
    # A field that is not a figure and differs between rounds is kept round by round.
    rounds[1]["off"]["1"]["target_version"] = "u"
    merged = spec_bench.merge_rounds(rounds)
    assert merged["off"]["1"]["target_version_by_round"] == ["t", "u", "t"]
    assert "target_version" not in merged["off"]["1"]
