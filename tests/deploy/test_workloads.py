"""The benchmarks' workloads (benchmarks/workloads.py): the standard library's code edits are
real functions with the edit asked, the same on every run; workloads combine by name; a
missing file or an unknown name is a clear exit, not a traceback."""

from __future__ import annotations

import importlib
import inspect
from collections import Counter

import pytest

from benchmarks import workloads


def test_code_edits_are_stdlib_functions_each_with_one_edit():
    edits = workloads.code_edits()
    assert edits == workloads.code_edits()  # (the same rows every time)
    assert set(Counter(r["category"] for r in edits)) == set(workloads.EDITS)
    assert min(Counter(r["category"] for r in edits).values()) >= 5
    assert len({r["question_id"] for r in edits}) == len(edits)
    for row in edits:
        kind, _, where = row["question_id"].partition("-")
        module, _, name = where.rpartition(".")
        source = inspect.getsource(getattr(importlib.import_module(module), name))
        prompt = row["turns"][0]
        assert row["category"] == kind and f"```python\n{source}```" in prompt
        assert workloads.MIN_LINES <= source.count("\n") <= workloads.MAX_LINES
        if kind == "edit_rename":
            param = prompt.split("`")[1]
            assert (
                param
                in inspect.signature(getattr(importlib.import_module(module), name)).parameters
            )
            assert f"`{param}_value`" in prompt


def test_workloads_combine_by_name_first_rows_of_each_category():
    rows = workloads.rows("code_edit,agentic", 2)
    assert Counter(r["category"] for r in rows) == dict.fromkeys([*workloads.EDITS, "agentic"], 2)
    agentic = [r for r in rows if r["category"] == "agentic"]
    assert all(r["system"] == agentic[0]["system"] for r in agentic)  # (one tool schema)
    messages = workloads.messages(agentic[0])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert [m["role"] for m in workloads.messages(rows[0])] == ["user"]


def test_the_side_by_side_prompts_are_a_workload_of_a_category_each():
    from benchmarks.prompts import PROMPTS

    rows = workloads.rows("prompts", 1)
    assert [r["category"] for r in rows] == list(PROMPTS)
    assert [r["turns"] for r in rows] == [[t] for t in PROMPTS.values()]


def test_a_perfect_cut_prices_each_step_by_its_accepted_path(tmp_path):
    from benchmarks.acceptance import pass_ms, perfect_cut_speedup, read_profile

    log = tmp_path / "verifier.log"
    log.write_text(
        '{"msg": "ready"}\n'
        '{"msg": "verify profile measured (ms by tokens in a pass)", '
        '"profile": {"1": 40.0, "2": 50.0, "4": 60.0, "8": 100.0}}\n'
    )
    profile = read_profile(log)
    assert profile == {1: 40.0, 2: 50.0, 4: 60.0, 8: 100.0}
    assert pass_ms(profile, 3) == 55.0 and pass_ms(profile, 10) == 120.0  # (past 8: its slope)
    # 8 tokens in 3 steps that kept 3, 0 and 2 drafts: 40 ms a token plain, 60 + 40 + 55 cut
    runs = [{"tokens": 8, "kept": [3, 0, 2]}]
    assert perfect_cut_speedup(runs, profile) == pytest.approx(8 * 40 / 155)
    (tmp_path / "other.log").write_text('{"msg": "ready"}\n{"msg": "stopped"}\n')
    with pytest.raises(SystemExit, match="no verify profile in .*other.log: pass a verifier's"):
        read_profile(tmp_path / "other.log")


def test_the_replay_counts_a_node_kept_where_the_output_follows_its_whole_path():
    """What the target kept of a scored tree, by node and by score bin: a node counts only if
    the output follows every node above it (a kept token under a rejected parent is not)."""
    import numpy as np

    from benchmarks.acceptance import kept_nodes, score_bins
    from specserve.speculation.policy import SCORE_BINS, count_by_bin
    from specserve.speculation.tree import DraftTree

    tree = DraftTree(model_free=True)
    a = tree.add(5, -1)  # 5 -> 6 -> 7, and 9 -> 6 (the 6 under a rejected 9)
    b = tree.add(6, a)
    tree.add(7, b)
    c = tree.add(9, -1)
    tree.add(6, c)
    tree.scores = [0.95, 0.62, 0.55, 0.31, 0.05]
    kept = kept_nodes(tree, [5, 6, 8])
    assert list(kept) == [True, True, False, False, False]
    assert list(kept_nodes(tree, [5])) == [True, False, False, False, False]  # (output ends)
    bins = np.zeros((2, SCORE_BINS))
    count_by_bin(*bins, tree.scores, kept)
    table = score_bins(*bins)
    assert [row["scores"] for row in table[:2]] == ["0.0-0.1", "0.1-0.2"]
    assert [(row["nodes"], row["kept"]) for row in table] == [
        (1, 0.0), (0, None), (0, None), (1, 0.0), (0, None), (1, 0.0), (1, 1.0), (0, None),
        (0, None), (1, 1.0),
    ]  # fmt: skip


def test_a_missing_file_or_unknown_name_says_what_to_pass(tmp_path):
    with pytest.raises(SystemExit, match="unknown workload 'prose'.*spec_bench, code_edit"):
        workloads.rows("prose", 1)
    with pytest.raises(SystemExit, match="no workload file at .*absent.jsonl"):
        workloads.rows(str(tmp_path / "absent.jsonl"), 1)
    (tmp_path / "mine.jsonl").write_text(
        '{"question_id": 1, "category": "a", "turns": ["hi"]}\n'
        '{"question_id": 2, "category": "a", "turns": ["yo"]}\n'
    )
    assert [r["question_id"] for r in workloads.rows(str(tmp_path / "mine.jsonl"), 1)] == [1]


def test_spec_bench_times_each_category_under_a_load_of_its_own_kind():
    """benchmarks.spec_bench at concurrency c: groups of c streams of one category each, every
    question answered at one concurrency only (the drafter learns answers), a category short
    of questions repeating its own within its group."""
    from benchmarks import spec_bench

    rows = workloads.rows("code_edit,agentic", 21)  # (Spec-Bench's file is not in the repo)
    by_level = spec_bench.groups(rows, [1, 4, 16], per_category=1)
    categories = {r["category"] for r in rows}
    used: dict[str, int] = {}
    for c, level in by_level.items():
        assert sorted(g[0]["category"] for g in level) == sorted(categories)
        for group in level:
            assert len(group) == c and len({r["category"] for r in group}) == 1
            for qid in {r["question_id"] for r in group}:
                assert used.setdefault(qid, c) == c
    counts = Counter(r["category"] for r in rows)
    for group in by_level[16]:
        assert len({r["question_id"] for r in group}) == counts[group[0]["category"]] - 1 - 4


def test_spec_bench_sets_config_keys_of_its_cluster_and_refuses_others_by_name():
    from benchmarks import spec_bench

    config = spec_bench.cluster_config(
        [4], "int8", ["drafter.proposer=suffix", "verifier.deep_tree_size=16"]
    )
    assert config["drafter"]["proposer"] == "suffix"
    assert config["verifier"]["deep_tree_size"] == 16  # (read as YAML: an int)
    assert config["verifier"]["batch_size"] == 4 and config["verifier"]["dtype"] == "int8"
    with pytest.raises(SystemExit, match="--set gateway.port=1: expected verifier.KEY=VALUE"):
        spec_bench.cluster_config([1], "auto", ["gateway.port=1"])
