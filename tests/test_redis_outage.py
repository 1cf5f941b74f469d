"""A Redis restart (with AOF, as deployments run it), seen from a drafter and a scheduler:
health goes NOT_SERVING and comes back SERVING, and the logs say once that Redis went away
and once that it came back, with no traceback."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import cluster_config
from specserve.local_cluster import LocalCluster, Proc

GONE = "redis unreachable; retrying"
BACK = "redis back after"


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    cluster = LocalCluster(cluster_config(tiny_model_dir), tmp_path, redis_aof=True)
    cluster.start(timeout=180, services=("scheduler", "drafter"))
    yield cluster
    cluster.stop()


def health(proc: Proc) -> int:
    with grpc.insecure_channel(proc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def wait_for(what: str, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.1)


def test_redis_outage_flips_drafter_health_and_logs_one_line_each_way(cluster):
    drafter, scheduler = cluster.procs["drafter"], cluster.procs["scheduler"]
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    wait_for("drafter serving", lambda: health(drafter) == serving)

    cluster.kill_redis()
    wait_for("drafter NOT_SERVING", lambda: health(drafter) == not_serving)
    # Once the client's own retries (about 6 s) give up, each loop says so, once.
    wait_for("heartbeat noticed", lambda: GONE in drafter.log_text())
    wait_for("placement noticed", lambda: GONE in scheduler.log_text())

    cluster.start_redis()
    wait_for("drafter SERVING", lambda: health(drafter) == serving)
    wait_for("heartbeat back", lambda: BACK in drafter.log_text())
    wait_for("placement back", lambda: BACK in scheduler.log_text())
    for proc in (drafter, scheduler):
        log = proc.log_text()
        assert log.count(GONE) == 1 and log.count(BACK) == 1, proc.name
        assert "Traceback" not in log, proc.name
