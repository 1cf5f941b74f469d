"""A Redis restart (with AOF, as deployments run it), seen from a drafter and a scheduler:
health goes NOT_SERVING and comes back SERVING, and the logs say once that Redis went away
and once that it came back, with no traceback."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import cluster_config
from helpers import wait_until
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


def test_redis_outage_flips_drafter_health_and_logs_one_line_each_way(cluster):
    drafter, scheduler = cluster.procs["drafter"], cluster.procs["scheduler"]
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    wait_until(lambda: health(drafter) == serving, "drafter serving")

    cluster.kill_redis()
    wait_until(lambda: health(drafter) == not_serving, "drafter NOT_SERVING")
    # Once the client's own retries (about 6 s) give up, each loop says so, once.
    wait_until(lambda: GONE in drafter.log_text(), "heartbeat noticed")
    wait_until(lambda: GONE in scheduler.log_text(), "placement noticed")

    cluster.start_redis()
    wait_until(lambda: health(drafter) == serving, "drafter SERVING")
    wait_until(lambda: BACK in drafter.log_text(), "heartbeat back")
    wait_until(lambda: BACK in scheduler.log_text(), "placement back")
    for proc in (drafter, scheduler):
        log = proc.log_text()
        assert log.count(GONE) == 1 and log.count(BACK) == 1, proc.name
        assert "Traceback" not in log, proc.name
