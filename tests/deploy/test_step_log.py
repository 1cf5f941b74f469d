"""benchmarks.step_log: a verifier DEBUG log summed per request (between its "admitted" and
"request ended" lines): decode steps, the time tree steps took beyond a one-token pass, the
drafter's asks, the nodes of trees left unchecked; prompt chunks left out."""

from __future__ import annotations

import json

import pytest

from benchmarks import step_log


def _step(tokens: int, ms: float, prefill: int = 0) -> dict:
    return {"msg": "step", "tokens": tokens, "prefill_tokens": prefill, "verify_ms": ms}


def test_each_request_sums_its_own_steps_trees_and_asks(tmp_path):
    lines = [
        {"msg": "admitted", "request_id": "a"},
        _step(40, 300.0, prefill=40),
        _step(1, 40.0),
        {"msg": "drafted", "budgets": [[3, 8]], "draft_ms": 90.0},
        _step(4, 70.0),
        {"msg": "checked", "nodes": 3, "accepted": 2},
        {"msg": "shadowed", "nodes": 5, "kept": 1},
        {"msg": "drafted", "budgets": [[0, 8]], "draft_ms": 2.0},
        _step(1, 42.0),
        _step(1, 38.0),
        {"msg": "request ended", "request_id": "a", "tokens": 6},
        _step(1, 99.0),  # (between requests: nobody's)
        {"msg": "admitted", "request_id": "b"},
        _step(1, 50.0),
        {"msg": "request ended", "request_id": "b", "tokens": 2},
    ]
    path = tmp_path / "verifier.log"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    a, b = step_log.requests(step_log.read(path))
    assert a == pytest.approx(
        {
            "request_id": "a",
            "tokens": 6,
            "steps": 4,
            "one_token_ms": 40.0,
            "trees": 1,
            "nodes": 3,
            "kept": 2,
            "tree_ms": 30,
            "asks": 2,
            "draft_ms": 92,
            "model_asks": 1,
            "model_draft_ms": 90,
            "shadow_nodes": 5,
            "shadow_kept": 1,
        }
    )
    assert b["steps"] == 1 and b["one_token_ms"] == 50.0 and b["trees"] == 0


def test_overlapping_requests_sum_as_one_group_with_the_time_between_their_steps(tmp_path):
    def at(ms: int, line: dict) -> dict:  # (a line logged `ms` after 12:00:00)
        return line | {"ts": f"2026-12-07T12:00:{ms // 1000:02d}.{ms % 1000:03d}Z"}

    lines = [
        at(0, {"msg": "admitted", "request_id": "a"}),
        at(5, {"msg": "admitted", "request_id": "b"}),
        at(500, _step(60, 490.0, prefill=60)),
        at(545, _step(2, 40.0)),  # (after a prompt step: not timed between)
        at(548, {"msg": "drafted", "budgets": [[0, 8], [0, 0]], "draft_ms": 4.0}),
        at(595, _step(4, 44.0)),  # 50 ms after the last, 44 of them its pass and 4 the ask
        at(596, {"msg": "checked", "nodes": 2, "accepted": 1}),
        at(640, _step(2, 41.0)),  # 45 ms after, 41 its pass
        at(641, {"msg": "request ended", "request_id": "a", "tokens": 4}),
        at(680, _step(1, 37.0)),
        at(681, {"msg": "request ended", "request_id": "b", "tokens": 4}),
        at(900, {"msg": "admitted", "request_id": "c"}),
        at(990, _step(5, 88.0, prefill=5)),
        at(991, {"msg": "request ended", "request_id": "c", "tokens": 1}),
    ]
    path = tmp_path / "verifier.log"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    first, second = step_log.groups(step_log.read(path))
    assert first == {
        "requests": 2,
        "wall_s": 0.68,
        "steps": 5,
        "prompt_steps": 1,
        "verify_s": 0.65,
        "prompt_verify_s": 0.49,
        "between_ms": 3.0,  # (2, 4 and 3 ms)
        "asks": 1,
        "draft_ms": 4,
        "nodes": 2,
        "kept": 1,
    }
    assert second["requests"] == 1 and second["steps"] == 1 and second["between_ms"] is None
