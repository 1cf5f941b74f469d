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
