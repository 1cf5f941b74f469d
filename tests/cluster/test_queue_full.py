"""A full queue answers RESOURCE_EXHAUSTED with a retry hint (a cluster with no verifier)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import request, scrape
from specserve.store import req_key
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.cluster  # every test here runs a cluster


@contextmanager
def without_verifiers(tmp_path, model_dir, **scheduler):
    """A scheduler and a gateway (with scheduler metrics), and a stub of the gateway."""
    config = cluster_config(model_dir, scheduler={"metrics_port": 0, **scheduler})
    cluster = LocalCluster(config, tmp_path)
    try:
        cluster.start(timeout=120, services=("scheduler", "gateway"))
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            yield cluster, generation_pb2_grpc.GenerationServiceStub(channel)
    finally:
        cluster.stop()


def test_full_queue_is_resource_exhausted(tmp_path, tiny_model_dir):
    with without_verifiers(tmp_path, tiny_model_dir, interactive_queue_limit=2) as (cluster, stub):
        r = redis.Redis.from_url(cluster.redis_url)
        queued = [
            stub.Generate(request(prompt="hi", request_id=f"q{i}"), timeout=30) for i in range(2)
        ]
        deadline = time.monotonic() + 10
        while not all(r.exists(req_key(f"q{i}")) for i in range(2)):
            assert time.monotonic() < deadline, "requests were not queued"
            time.sleep(0.05)

        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(prompt="hi", request_id="q-over"), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        assert ("retry-after-ms", "1000") in (err.value.trailing_metadata() or ())
        port = cluster.procs["scheduler"].metrics_port
        assert scrape(port)['specserve_scheduler_rejected_total{priority="interactive"}'] == 1
        deadline = time.monotonic() + 5  # the placement loop refreshes the gauge (every 50 ms)
        while scrape(port)['specserve_scheduler_queue_depth{priority="interactive"}'] != 2:
            assert time.monotonic() < deadline, "the queue depth gauge never showed 2"
            time.sleep(0.05)

        for i, call in enumerate(queued):  # cancelling a queued request ends its stream
            assert stub.Cancel(
                generation_pb2.CancelRequest(request_id=f"q{i}"), timeout=5
            ).cancelled
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.CANCELLED


def test_waiting_past_the_class_timeout_is_deadline_exceeded(tmp_path, tiny_model_dir):
    timeout = {"interactive_queue_timeout_seconds": 1}
    with without_verifiers(tmp_path, tiny_model_dir, **timeout) as (cluster, stub):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(prompt="hi"), timeout=30))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "waited in the interactive queue past 1s" in err.value.details()
        assert time.monotonic() - started < 10
        metrics = scrape(cluster.procs["scheduler"].metrics_port)
        assert metrics['specserve_scheduler_expired_total{priority="interactive"}'] == 1
