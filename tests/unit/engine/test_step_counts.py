"""The host-side step counter (benchmarks/step_counts.py) counts what it says it counts:
reads of tensor data into Python (a device sync on a GPU), tensors made from host data and
blocking moves (a host-to-device copy on a GPU), ATen ops, and the ops that allocate; and it
sees those of a real Engine.step (the figures of record come from the benchmark)."""

from __future__ import annotations

import itertools

import torch

from benchmarks.step_counts import StepCounter, count_draft, count_step
from conftest import DEVICE
from specserve.engine import models
from specserve.speculation.proposer import TreeShape
from specserve.tools.local_cluster import LocalCluster


def test_the_counter_counts_reads_copies_and_ops():
    t = torch.arange(6.0)
    with StepCounter() as c:
        t.sum().item()
        t.tolist()
        if bool(t[0] > 1):
            pass
        torch.tensor([1, 2, 3], device="cpu")
        torch.tensor([4, 5])  # (made on the host, kept there: no copy)
        t.to("cpu")
        t.to("cpu", non_blocking=True)  # (pinned, asynchronous: not a blocking copy)
        t.to(torch.float64)  # (no device: not a move)
    assert c.counts["syncs"] == 3
    assert {k: v for k, v in c.counts.items() if k.startswith("sync:")} == {
        "sync:item": 1,
        "sync:tolist": 1,
        "sync:__bool__": 1,
    }
    assert c.counts["host_copies"] == 2
    with StepCounter() as views:
        t.view(2, 3)
        t.add_(1)
    assert views.counts["ops"] == 2 and views.counts["allocating_ops"] == 0
    with StepCounter() as new:
        t * 2
    assert new.counts["ops"] == new.counts["allocating_ops"] == 1


def test_the_counter_sees_a_real_engine_step(tiny_model_dir, tmp_path):
    model = models.load_model(tiny_model_dir, DEVICE, "float32")
    redis = LocalCluster({}, tmp_path)
    try:
        url = redis.start_redis()
        one = count_step(model, url, batch=1, nodes=8, context=32, sampled=False)
        four = count_step(model, url, batch=4, nodes=8, context=32, sampled=True)
    finally:
        redis.kill_redis()
    for counts in (one, four):
        assert counts["syncs"] > 0 and counts["ops"] > counts["allocating_ops"] > 0
    assert four["ops"] > one["ops"]  # (four sequences' work, sampled)


def test_a_steps_syncs_and_host_copies_do_not_grow_with_its_batch(tiny_model_dir, tmp_path):
    """What crosses between host and device per step is per step, not per sequence (each
    sequence's tree mask once took a copy of its own)."""
    model = models.load_model(tiny_model_dir, DEVICE, "float32")
    redis = LocalCluster({}, tmp_path)
    try:
        url = redis.start_redis()
        for sampled in (False, True):
            two, eight = (
                count_step(model, url, batch=b, nodes=8, context=32, sampled=sampled)
                for b in (2, 8)
            )
            for kind in ("syncs", "host_copies"):
                assert two[kind] == eight[kind], (kind, sampled, two, eight)
    finally:
        redis.kill_redis()


def test_a_step_reads_its_results_once_greedy_and_twice_sampled_at_any_batch(
    tiny_model_dir, tmp_path
):
    """At most two device-to-host reads a verifier step (greedy: one, its verdicts and finite
    flags together; sampled: a second for the bonus tokens), no blocking host-to-device copy
    (the step buffer's one copy is non-blocking; rotary positions are a table lookup), at
    batch 1, 8 and 64 with 8-node trees; a greedy step's ATen
    ops the same at batch 8 and 64 (its layout is numpy, no torch op per sequence)."""
    model = models.load_model(tiny_model_dir, DEVICE, "float32")
    redis = LocalCluster({}, tmp_path)
    try:
        url = redis.start_redis()
        for sampled in (False, True):
            counts = {
                b: count_step(model, url, batch=b, nodes=8, context=32, sampled=sampled)
                for b in (1, 8, 64)
            }
            for b, c in counts.items():
                assert c["syncs"] == (2 if sampled else 1), (b, sampled, c)
                assert c["host_copies"] == 0, (b, sampled, c)
            if not sampled:
                assert counts[8]["ops"] == counts[64]["ops"], counts
    finally:
        redis.kill_redis()


def test_a_draft_model_reads_the_device_once_a_level_at_any_batch(tiny_draft):
    """A draft-model tree of depth 4 (branching 2, width 4: 14 nodes or more) reads its choices from
    the device once per level for the whole batch, greedy or sampled, at 1 and 8 sequences;
    its ATen ops grow with the levels, not with the sequences (it once read every node's
    choices apart: 44 reads at 1 greedy sequence, 792 at 8 sampled; 692 and 2,105 ops at 1
    and 8 greedy)."""
    shape = TreeShape(max_depth=4, branching=2, width=4)
    for temperature in (0.0, 0.8):
        one, eight = (count_draft(tiny_draft, b, shape, temperature) for b in (1, 8))
        for counts in (one, eight):
            assert counts["least_nodes"] >= 14, (temperature, counts)
            assert counts["syncs"] == shape.max_depth, (temperature, counts)
            assert counts["host_copies"] == 0, (temperature, counts)
        assert eight["ops"] <= 1.25 * one["ops"], (temperature, one["ops"], eight["ops"])


def test_a_draft_model_chain_reads_the_device_once(tiny_draft):
    """A chain feeds each level's tokens (argmax or draw) to the next pass on the device: one
    read for the whole chain of depth 4, greedy or sampled, at 1 and 8 sequences."""
    shape = TreeShape(max_depth=4, branching=1, width=1)
    for batch, temperature in itertools.product((1, 8), (0.0, 0.8)):
        counts = count_draft(tiny_draft, batch, shape, temperature)
        assert counts["least_nodes"] == shape.max_depth, (batch, temperature, counts)
        assert counts["syncs"] == 1, (batch, temperature, counts)
        assert counts["host_copies"] == 0, (batch, temperature, counts)
