"""Minutes-long reasoning: one request of thousands of output tokens through the whole cluster
(tiny model, CPU), its gateway SIGKILLed a third of the way in and started again; the client
re-attaches with resume_from and ends with every token once, as Redis holds them. `make test`
runs 3,000 tokens, `make test-long` 8,000 (what the defaults allow)."""

from __future__ import annotations

import signal
import threading

import pytest

from conftest import cluster_config
from helpers import Client, wait_until
from specserve.common.settings import GatewaySettings, VerifierSettings
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster, free_port
from specserve.v1 import common_pb2


def test_defaults_allow_8k_outputs():
    gateway, verifier = GatewaySettings(), VerifierSettings()
    assert gateway.max_tokens_limit >= 8192 and gateway.tiers["standard"].max_tokens >= 8192
    assert gateway.max_seq_len >= 8192 + 4096 and verifier.max_seq_len == gateway.max_seq_len


@pytest.mark.cluster
@pytest.mark.parametrize("tokens", [3000, pytest.param(8000, marks=pytest.mark.long)])
def test_a_long_output_survives_a_gateway_kill_and_resume(tmp_path, tiny_model_dir, tokens):
    config = cluster_config(
        tiny_model_dir,
        gateway={"max_seq_len": 8192, "max_tokens_limit": tokens},
        verifier={"max_seq_len": 8192, "batch_size": 2},
    )
    cluster = LocalCluster(config, tmp_path).start(timeout=180, gateway_port=free_port())
    try:
        store = RequestStore.from_url(cluster.redis_url)
        client = Client("long-reasoning", [3, 1, 4, 1, 5, 9, 2, 6], max_tokens=tokens)
        thread = threading.Thread(target=client.run, args=(cluster.procs["gateway"].address, 600))
        thread.start()
        wait_until(lambda: client.received >= tokens // 3, f"{tokens // 3} tokens streamed", 300)
        port = cluster.procs["gateway"].port
        cluster.kill("gateway", signal.SIGKILL)
        assert client.final is None, "the request ended before the kill"
        env = {"SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler"].address}
        cluster.start_service("gateway", env, port=port)
        cluster.wait_ready("gateway", 120)
        thread.join(timeout=600)
        assert not thread.is_alive(), "the stream hung"
        assert client.error == "" and client.final is not None
        assert client.reattached >= 1
        indices = client.indices()
        assert len(indices) == len(set(indices)), "an index arrived twice"
        assert sorted(indices) == list(range(len(indices))), "an index is missing"
        assert client.ids() == store.progress("long-reasoning")
        assert client.final.usage.completion_tokens == len(indices)
        finish = client.final.finish_reason  # all of max_tokens, unless the model said EOS
        if len(indices) < tokens:
            assert finish == common_pb2.FINISH_REASON_EOS, (len(indices), finish)
        else:
            assert finish == common_pb2.FINISH_REASON_LENGTH
    finally:
        cluster.stop()
