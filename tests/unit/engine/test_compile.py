"""The compiled forward: the same tokens as eager and as HF generate, bounded recompiles,
and a compile failure that names its config key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CPU_KERNELS
from helpers import make_sequence
from specserve.engine.compiler import CompileFailed, Compiler
from specserve.engine.flat_model import FlatModel, Segment
from specserve.speculation.draft_model import DraftModelProposer
from specserve.speculation.proposer import DraftJob, TreeShape
from specserve.speculation.tree import DraftTree
from specserve.verifier.reference import hf_greedy
from specserve.verifier.runner import tree_segment


@pytest.fixture(scope="module")
def compiled(tiny_model):
    model, _ = FlatModel.prepare(tiny_model, compile=True, key="verifier.compile")
    return model


def greedy(flat: FlatModel, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy decoding of several prompts in one batch, one token per step."""
    kvs = [flat.new_kv() for _ in prompts]
    rows = flat.forward([Segment(kv, p) for kv, p in zip(kvs, prompts, strict=True)])
    out = [[int(r[-1].argmax())] for r in rows]
    for _ in range(tokens - 1):
        rows = flat.forward([Segment(kv, o[-1:]) for kv, o in zip(kvs, out, strict=True)])
        for o, r in zip(out, rows, strict=True):
            o.append(int(r[-1].argmax()))
    return out


def test_compiled_greedy_equals_hf_generate_in_a_batch(tiny_model, compiled):
    prompts = [list(range(10, 10 + n)) for n in (5, 23, 11)]
    for prompt, out in zip(prompts, greedy(compiled, prompts, 12), strict=True):
        assert out == hf_greedy(tiny_model, prompt, 12)


def test_compiled_tree_rows_equal_eager(tiny_model, compiled):
    eager = FlatModel(tiny_model)
    tree = DraftTree()
    a = tree.add(7, -1)
    tree.add(8, -1)
    tree.add(9, a)
    results = []
    for flat in (eager, compiled):
        seq = make_sequence(list(range(40, 70)))
        seq.kv = flat.new_kv()
        (rows,) = flat.forward([tree_segment(seq, tree)])
        results.append(rows)
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)


def test_recompiles_are_bounded_as_batches_change(compiled):
    greedy(compiled, [[1, 2, 3]], 2)
    before = compiled.graphs
    for n in (1, 2, 7, 33, 130):  # token counts the warm-up never saw
        greedy(compiled, [list(range(5, 5 + n)), [4] * (n + 3)], 3)
    assert compiled.graphs == before


def test_a_compile_failure_stops_the_start_naming_the_key(tiny_model, monkeypatch):
    def broken(self, gm, example_inputs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(Compiler, "_backend", broken)
    with pytest.raises(CompileFailed, match=r"verifier\.compile: torch\.compile failed .*C\+\+"):
        FlatModel.prepare(tiny_model, compile=True, key="verifier.compile")


def random_tree(rng: np.random.Generator, nodes: int) -> DraftTree:
    tree = DraftTree()
    for i in range(nodes):
        tree.add(int(rng.integers(3, 500)), int(rng.integers(-1, i)) if i else -1)
    return tree


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
@pytest.mark.parametrize("attention", [pytest.param("paged", marks=CPU_KERNELS), "padded"])
def test_graph_steps_give_the_eager_forwards_rows(tiny_model, attention, buckets):
    """Batches of prompts, draft trees, kept paths (KV moves) and decode tokens, sequences of
    different contexts joining and leaving: each step through one compiled graph gives the
    rows the eager forward gives, and nothing compiles after the warm-up; with the shapes
    rounded up to buckets (CUDA's layout) as well, padding rows and sequences included."""
    rng = np.random.default_rng(7)
    eager = FlatModel(tiny_model, attention=attention)
    compiled, _ = FlatModel.prepare(
        tiny_model, compile=True, key="verifier.compile", attention=attention
    )
    compiled.graph.padded = buckets
    assert compiled.attention == attention
    warmed_up = compiled.graphs
    flats = (eager, compiled)
    seqs = {flat: [] for flat in flats}
    graphs = []
    for round_ in range(6):
        joining = [list(rng.integers(3, 500, int(rng.integers(2, 60)))) for _ in range(2)]
        trees = [random_tree(rng, int(rng.integers(1, 9))) for _ in range(6)]
        results = []
        for flat in flats:
            for prompt in joining:
                seq = make_sequence(prompt)
                seq.kv = flat.new_kv()
                seqs[flat].append(seq)
            live = seqs[flat][-5:]  # (the oldest leave)
            segments = [tree_segment(seq, tree) for seq, tree in zip(live, trees, strict=False)]
            rows = flat.forward(segments)
            for seq, tree in zip(live, trees, strict=False):  # keep node 0 and a child of it
                path = [0, *[i for i, p in enumerate(tree.parents) if p == 0][:1]]
                seq.kv.keep(seq.kv.length - len(tree), path)
                seq.output_ids.extend([tree.token_ids[i] for i in path] + [round_ + 3])
            rows += flat.forward([Segment(live[0].kv, live[0].pending_input())])  # (one token)
            results.append(rows)
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
        graphs.append(compiled.graphs)
    assert compiled.graph.steps >= 6
    assert graphs == [warmed_up] * len(graphs), f"after {warmed_up} at warm-up: {graphs}"


@pytest.mark.parametrize("attention", [pytest.param("paged", marks=CPU_KERNELS), "padded"])
@pytest.mark.parametrize("shape", [TreeShape(4, 1, 1), TreeShape(4, 2, 3)], ids=["chain", "tree"])
def test_a_draft_models_levels_run_as_graph_steps_and_draft_what_eager_drafts(
    tiny_model, shape, attention
):
    """A chain's levels (token ids already on the device) and a tree's (masks over the levels
    fed before them) go through the graph, draft the trees the eager forward drafts, and
    compile nothing after the warm-up."""
    compiled, _ = FlatModel.prepare(
        tiny_model, compile=True, key="drafter.compile", attention=attention
    )
    warmed_up = compiled.graphs
    trees = []
    for flat in (FlatModel(tiny_model, attention=attention), compiled):
        proposer = DraftModelProposer(flat, shape, sample_support=8)
        jobs = [
            DraftJob(f"s{i}", list(range(7 + i, 30 + 5 * i)), budget=12, temperature=t, seed=i)
            for i, t in enumerate((0.0, 0.0, 0.9))
        ]
        proposer.propose(jobs)  # (takes in the prompts)
        steps = flat.graph.steps if flat.graph else 0
        for job in jobs:
            job.tokens = job.tokens + [11, 12]
        trees.append([(t.token_ids, t.parents) for t in proposer.propose(jobs)])
        if flat.graph:
            assert flat.graph.steps - steps >= shape.max_depth - 1
    assert trees[0] == trees[1]
    assert all(len(ids) > 1 for ids, _ in trees[1])
    assert compiled.graphs == warmed_up
