"""Quantised weights moved onto huge pages (engine/hugepages.py): one arena, shared rows still
shared, the same outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.engine import hugepages
from specserve.engine.layers import joined
from specserve.engine.quant import Int4Linear


def test_quantised_weights_move_into_one_arena_and_compute_the_same():
    if not hugepages.available():
        pytest.skip("this kernel gives no transparent huge pages (THP: never)")
    torch.manual_seed(0)
    gate, up = Int4Linear(nn.Linear(256, 512)), Int4Linear(nn.Linear(256, 512))
    down = Int4Linear(nn.Linear(512, 256))
    fused = joined([gate, up])  # gate's and up's buffers become views of fused's
    x, h = torch.randn(3, 256), torch.randn(3, 512)
    layers = [fused, gate, up, down]
    before = [fused(x), gate(x), up(x), down(h)]
    shared = up.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr()

    moved = hugepages.to_huge_pages(layers)

    tensors = [t for m in layers for t in (m.packed, m.scale_offset)]
    assert moved >= sum(t.numel() * t.element_size() for t in (fused.packed, down.packed))
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one arena
    if shared:  # the parts' rows are still the joined layer's rows, not copies
        assert up.packed.data_ptr() == fused.packed[gate.packed.shape[0] :].data_ptr()
    for t in (fused.packed, fused.scale_offset, down.packed, down.scale_offset):
        assert t.data_ptr() % hugepages.ALIGN == 0
    after = [fused(x), gate(x), up(x), down(h)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
