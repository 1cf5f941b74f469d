"""A step's int4 layers as one kernel call (layers.Int4Layers, kernels/layers_cpu.cpp): the
logits and KV entries of the layers run one module call at a time, bit for bit, for prompts,
decode tokens, draft trees and several sequences in one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DEVICE, save_tiny_qwen
from specserve.engine import kernels, models
from specserve.engine.batch import SHORT_TOKENS
from specserve.engine.flat_model import FlatModel, Segment

pytestmark = pytest.mark.skipif(
    DEVICE != "cpu" or not kernels.available(), reason="the engine's CPU kernels run on x86 CPUs"
)

TREE = np.array(  # 4 new tokens: a root, two children of it, a grandchild of the second
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool
)


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory, tokenizer):
    path = save_tiny_qwen(
        tmp_path_factory.mktemp("int4-layers"), tokenizer, hidden_size=128, intermediate_size=256
    )
    return models.load_model(path, DEVICE, "int4")


def steps(flat: FlatModel) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every kind of step on fresh sequences: each step's logits, then every sequence's KV
    entries (keys and values of every layer at its slots)."""
    a, b, c = flat.new_kv(), flat.new_kv(), flat.new_kv()
    logits = []
    logits += flat.forward([Segment(a, list(range(100, 109)), logits_from=0)])  # a prompt
    logits += flat.forward([Segment(a, [7])])  # a decode token
    n = a.length
    logits += flat.forward(  # a draft tree: positions by depth, each node sees its ancestors
        [Segment(a, [11, 12, 13, 14], positions=[n, n + 1, n + 1, n + 2], mask=TREE, logits_from=0)]
    )
    logits += flat.forward([Segment(b, list(range(200, 206)))])  # a second sequence
    n = a.length
    logits += flat.forward(  # two sequences in one step: a decode token and a tree
        [
            Segment(b, [21]),
            Segment(
                a, [31, 32, 33, 34], positions=[n, n + 1, n + 1, n + 2], logits_from=0, mask=TREE
            ),
        ]
    )
    chunk = list(range(300, 300 + SHORT_TOKENS + 6))  # (past SHORT_TOKENS: a group of its own)
    logits += flat.forward([Segment(c, chunk), Segment(b, [22])])  # a prompt chunk, a token
    entries = []
    for kv in (a, b, c):
        slots = torch.as_tensor(kv.slots(0, kv.length))
        entries += [flat.pool.keys[:, slots], flat.pool.values[:, slots]]
    return logits, entries


def test_int4_layers_give_the_module_calls_bits(int4_model, monkeypatch):
    flat = FlatModel(int4_model)
    assert flat.int4_layers is not None  # int4 on the CPU kernels, a SiLU MLP
    by_call = flat.int4_layers
    flat.int4_layers = None
    expected_logits, expected_entries = steps(flat)

    flat.int4_layers = by_call
    module_steps = []
    layer_by_layer = flat.layer_by_layer
    monkeypatch.setattr(
        flat,
        "layer_by_layer",
        lambda batch, *a: module_steps.append(batch) or layer_by_layer(batch, *a),
    )
    logits, entries = steps(flat)
    # only the step that mixes a prompt chunk with a decode token (two attention groups) ran
    # the layers one call at a time
    assert [len(batch.groups) for batch in module_steps] == [2]
    assert len(logits) == len(expected_logits)
    for got, want in zip(logits, expected_logits, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(entries, expected_entries, strict=True):
        assert torch.equal(got, want)


def test_layers_the_kernel_does_not_run_stay_module_calls(tiny_model, int4_model):
    assert FlatModel(tiny_model).int4_layers is None  # float32 weights
    assert FlatModel(int4_model, attention="padded").int4_layers is None  # torch's attention
