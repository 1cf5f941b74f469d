"""`specserve plan` against numbers computed by hand. Its bounds against a decode and a
prefill timed here are a benchmark (benchmarks/plan_check.py), not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import default_target_dir
from specserve.tools.plan import (
    PRESETS,
    Load,
    expected_tokens,
    measure_this_machine,
    plan,
    shape_from_config,
    shape_from_dir,
)

LLAMA_70B = {  # Llama 3 70B's config.json (the fields the plan reads)
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "model_type": "llama",
}


def value(result: dict, name: str):
    return result[name]["value"]


def test_a_70b_model_by_hand():
    shape = shape_from_config(LLAMA_70B)
    # embeddings + lm_head 2 * 128256 * 8192; per layer q, o 8192^2 each, k, v 8192 * 1024
    # each, MLP 3 * 8192 * 28672, two norms; 80 layers; the final norm.
    per_layer = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert shape.params == 2 * 128256 * 8192 + 80 * per_layer + 8192 == 70_553_706_496
    assert shape.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2 == 327_680
    load = Load(concurrency=32, prompt_tokens=2048, output_tokens=512)
    result = plan(shape, None, PRESETS["h200"], load)
    assert value(result, "weight_bytes") == 141_107_412_992
    assert value(result, "fits_one_device") is False  # 141 GB of weights > 90% of 141 GB
    assert value(result, "devices_per_verifier_needed") == 2
    assert value(result, "kv_bytes_for_the_load") == 32 * 2560 * 327_680
    # Prefill: 2 FLOPs per parameter and prompt token, the embedding table and the LM head
    # (2 * 128256 * 8192, untied) aside but for the last token's logits; on the 2 devices the
    # weights need, at the H200's 989 TFLOP/s each.
    flops = 2 * (70_553_706_496 - 2 * 128256 * 8192) * 2048 + 2 * 128256 * 8192
    assert shape.prefill_flops(2048) == flops == 280_382_968_692_736
    assert value(result, "ttft_floor_s") == pytest.approx(flops / (2 * 989e12))  # 0.142 s


def test_a_70b_model_over_two_and_three_devices():
    """Over 2 H200s (verifier.tensor_parallel: 2) a verifier holds 70B with room for KV and
    reads it at twice one device's bandwidth; 3 does not divide its 64 heads."""
    shape = shape_from_config(LLAMA_70B)
    load = Load(concurrency=32, prompt_tokens=2048, output_tokens=512, tensor_parallel=2)
    result = plan(shape, None, PRESETS["h200"], load)
    weights, kv_token = 141_107_412_992, 327_680
    assert value(result, "tensor_parallel") == 2
    assert value(result, "weights_fit_tensor_parallel") is True
    per_verifier = (2 * 141e9 * 0.9 - weights) // (2560 * kv_token)
    assert value(result, "sequences_per_verifier") == min(64, per_verifier)
    assert value(result, "devices") == 2
    ceiling = 2 * 4.8e12 / (weights + 2304 * kv_token)  # mean context 2048 + 512 / 2
    assert value(result, "plain_decode_ceiling_tokens_s_per_stream") == pytest.approx(ceiling)
    assert value(result, "tensor_parallel_divides_model") is True
    three = plan(shape, None, PRESETS["h200"], replace(load, tensor_parallel=3))
    assert value(three, "tensor_parallel_divides_model") is False
    one = plan(shape, None, PRESETS["h200"], replace(load, tensor_parallel=1))
    assert value(one, "weights_fit_tensor_parallel") is False
    assert value(one, "sequences_per_verifier") == 0


def test_the_default_pair_by_hand():
    target = shape_from_dir(default_target_dir())
    assert target.kv_bytes_per_token(2) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert target.source.startswith("measured")
    computed = shape_from_config(json.loads((default_target_dir() / "config.json").read_text()))
    assert abs(computed.params - target.params) / target.params < 1e-3
    device = PRESETS["h100-80gb"]
    load = Load(concurrency=16, prompt_tokens=1000, output_tokens=200, acceptance=0.5)
    result = plan(target, target, device, load)
    weights = target.params * 2
    # a step at batch 1 reads the weights and one sequence's KV at the mean context (1100)
    ceiling = device.bandwidth_bytes_s / (weights + 1100 * 28_672)
    assert value(result, "plain_decode_ceiling_tokens_s_per_stream") == pytest.approx(ceiling)
    per_verifier = (80e9 * 0.9 - weights) // (1200 * 28_672)
    assert value(result, "sequences_per_verifier") == min(64, per_verifier)
    assert value(result, "verifier_replicas") == 1
    assert expected_tokens(0.5, 3) == 1.875
    # a draft as large as the target never pays: depth 0, no speedup
    assert value(result, "draft_depth") == 0 and value(result, "speculative_speedup") == 1
    # The converted target keeps its LM head apart from the embedding table (untied): both
    # are left out of the per-token FLOPs, the head counts for the last token's logits.
    assert not target.tied_embeddings
    table = 151936 * 1536
    flops = 2 * (target.params - 2 * table) * 1000 + 2 * table
    assert value(result, "ttft_floor_s") == pytest.approx(flops / 989e12)
    step = (weights + 16 * 1100 * 28_672) / device.bandwidth_bytes_s  # the batch: 16 streams
    assert value(result, "ttft_estimate_s") == pytest.approx(flops / 989e12 / 0.5 + step)


def test_this_machine_is_measured_and_planned_for():
    """What the plan says of this machine, whatever its speed (the measured decode and
    prefill against these bounds are a benchmark: `python -m benchmarks.plan_check`)."""
    device = measure_this_machine(sample_bytes=1 << 26, dtype="bfloat16")
    assert device.source == "measured" and device.memory_bytes > 0
    assert device.bandwidth_bytes_s > 0 and device.flops > 0
    shape = shape_from_dir(default_target_dir())
    result = plan(shape, None, device, Load(1, 128, 24))
    assert result["device_bandwidth_bytes_s"]["source"] == "measured"
    weights = shape.params * 2  # bfloat16
    # a step at batch 1 reads the weights and the KV of one sequence at the mean context (140)
    ceiling = device.bandwidth_bytes_s / (weights + 140 * shape.kv_bytes_per_token(2))
    assert value(result, "plain_decode_ceiling_tokens_s_per_stream") == pytest.approx(ceiling)
    floor = shape.prefill_flops(128) / device.flops
    assert value(result, "ttft_floor_s") == pytest.approx(floor)
    assert value(result, "ttft_estimate_s") > floor


def test_the_command_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.tools.cli",
            "plan",
            "--device",
            "h200",
            "--acceptance",
            "0.6",
            "--concurrency",
            "64",
            "--target-tokens-per-s",
            "50",
            "--target-ttft-ms",
            "500",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "verifier_replicas" in run.stdout and "speculative_speedup" in run.stdout
    result = json.loads(out.read_text())
    assert result["acceptance_per_draft_token"] == {"value": 0.6, "source": "given"}
    assert result["device_bandwidth_bytes_s"]["source"] == "assumed"
    assert result["target_params"]["source"] == "measured: weights file"
    assert result["speculative_speedup"]["value"] > 1
    assert isinstance(result["meets_target_tokens_s"]["value"], bool)
    assert result["prefill_efficiency"]["source"] == "assumed"
    assert result["meets_target_ttft"]["value"] is True  # 512 tokens of 1.5B on an H200
