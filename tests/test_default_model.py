"""The default target model (Qwen2.5-Coder-1.5B-Instruct, float32) through the whole cluster."""

from __future__ import annotations

import grpc
import pytest

from conftest import cluster_config, default_target_dir
from helpers import generate, request
from specserve.common import models
from specserve.local_cluster import LocalCluster
from specserve.v1 import generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.default_model


def test_default_target_greedy_matches_hf(tmp_path, tokenizer):
    config = cluster_config(
        None, verifier={"batch_size": 2, "torch_threads": 0}, drafter={"proposer": "ngram"}
    )
    cluster = LocalCluster(config, tmp_path)
    try:
        cluster.start(timeout=300)
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
            assert info.sha256 == models.CATALOG[(info.name, info.version)].sha256
            req = request(max_tokens=12)
            req.messages.messages.add(role="user", content="Write a haiku about Redis.")
            res = generate(stub, req, timeout=300)
    finally:
        cluster.stop()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about Redis."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    model = models.load_model(default_target_dir(), "cpu", "float32")
    assert res.ids == hf_greedy(model, tokenizer(text).input_ids, 12)
    assert res.text.strip()
