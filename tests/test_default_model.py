"""The default pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, float32) through the
whole cluster: greedy output with speculation on and off equals plain Hugging Face."""

from __future__ import annotations

import grpc
import pytest

from conftest import DEVICE, cluster_config, default_target_dir
from helpers import generate, request
from specserve.common import models
from specserve.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.default_model


def test_default_pair_greedy_matches_hf_with_speculation_on_and_off(tmp_path, tokenizer):
    config = cluster_config(
        None,
        verifier={"batch_size": 2, "torch_threads": 0, "speculative_decoding": True},
        drafter={"max_depth": 4, "dtype": "int8" if DEVICE == "cpu" else "float32"},
    )
    cluster = LocalCluster(config, tmp_path)
    try:
        cluster.start(timeout=300)
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
            assert info.sha256 == models.CATALOG[(info.name, info.version)].sha256
            results = {}
            for mode in (common_pb2.SPECULATION_MODE_AUTO, common_pb2.SPECULATION_MODE_OFF):
                req = request(max_tokens=12, speculation=common_pb2.SpeculationOptions(mode=mode))
                req.messages.messages.add(role="user", content="Write a haiku about Redis.")
                results[mode] = generate(stub, req, timeout=300)
    finally:
        cluster.stop()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about Redis."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    model = models.load_model(default_target_dir(), DEVICE, "float32")
    expected = hf_greedy(model, tokenizer(text).input_ids, 12)
    on, off = results[common_pb2.SPECULATION_MODE_AUTO], results[common_pb2.SPECULATION_MODE_OFF]
    assert on.ids == expected
    assert off.ids == expected
    assert on.text.strip()
    assert on.final.speculation.drafted_tokens > 0
    assert on.final.speculation.accepted_tokens > 0
    assert on.final.speculation.steps < 12
    assert off.final.speculation.drafted_tokens == 0
