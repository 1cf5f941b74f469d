"""A Redis restart (with AOF, as deployments run it), seen from a drafter and a scheduler:
health goes NOT_SERVING and comes back SERVING, and the logs say once that Redis went away
and once that it came back, with no traceback. The kubelet's probe port says the same for
readiness and stays live throughout, so an outage restarts nothing; it answers from the start,
before Redis does."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import cluster_config
from helpers import wait_until
from specserve.common.grpc_server import Server
from specserve.common.probes import Probes
from specserve.local_cluster import LocalCluster, Proc, free_port

GONE = "redis unreachable; retrying"
BACK = "redis back after"


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    config = cluster_config(tiny_model_dir, common={"health_port": 0})
    cluster = LocalCluster(config, tmp_path, redis_aof=True)
    cluster.start(timeout=180, services=("scheduler", "drafter"))
    yield cluster
    cluster.stop()


def health(proc: Proc) -> int:
    with grpc.insecure_channel(proc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def probe(port: int, service: str) -> int | None:
    """The probe port's answer (plaintext, as the kubelet asks); None while it is not up."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return None


def test_redis_outage_flips_drafter_health_and_logs_one_line_each_way(cluster):
    drafter, scheduler = cluster.procs["drafter"], cluster.procs["scheduler"]
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    wait_until(lambda: health(drafter) == serving, "drafter serving")
    for proc in (drafter, scheduler):
        assert (
            probe(proc.health_port, "readiness") == probe(proc.health_port, "liveness") == serving
        )

    cluster.kill_redis()
    wait_until(lambda: health(drafter) == not_serving, "drafter NOT_SERVING")
    wait_until(lambda: probe(drafter.health_port, "readiness") == not_serving, "probe not ready")
    for proc in (drafter, scheduler):
        assert probe(proc.health_port, "liveness") == serving, proc.name  # nothing to restart
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


def test_the_probe_port_answers_before_redis_does(tmp_path, tiny_model_dir):
    """A service started before Redis waits for it; meanwhile its probe port answers: not
    started (liveness NOT_SERVING, for the startup probe's budget) and not ready."""
    port, probes = free_port(), free_port()
    cluster = LocalCluster(
        cluster_config(tiny_model_dir), tmp_path, redis_url=f"redis://127.0.0.1:{port}/0"
    )
    cluster.start(services=())  # (the config only: Redis is not there)
    try:
        env = {"SPECSERVE_SCHEDULER_HEALTH_PORT": str(probes)}
        cluster.start_service("scheduler", env, wait=False)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: probe(probes, "liveness") == not_serving, "probe port up", timeout=60)
        assert probe(probes, "readiness") == not_serving
        log = cluster.procs["scheduler"].log_text
        wait_until(lambda: "unreachable; waiting" in log(), "waiting for Redis")
        cluster.redis_port = port
        cluster.start_redis()
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_until(lambda: probe(probes, "liveness") == serving, "started", timeout=60)
        wait_until(lambda: probe(probes, "readiness") == serving, "ready", timeout=60)
    finally:
        cluster.stop()


def test_liveness_fails_while_a_liveness_check_fails():
    """A process whose own loop or engine is broken stops being live (the kubelet restarts
    it); one whose readiness check of another service fails stays live."""
    server = Server("127.0.0.1", 0, ["specserve.v1.Test"])
    probes = Probes("127.0.0.1", 0, liveness_seconds=1.0)
    probes.attach(server)
    engine_ok, redis_ok = [True], [True]
    server.watch(
        {"redis reachable": lambda: redis_ok[0]},
        period=0.05,
        liveness={"engine": lambda: engine_ok[0]},
    )
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        wait_until(lambda: probe(probes.port, "readiness") == serving, "ready")
        assert probe(probes.port, "liveness") == serving
        redis_ok[0] = False
        wait_until(lambda: probe(probes.port, "readiness") == not_serving, "not ready")
        assert probe(probes.port, "liveness") == serving  # another service's outage
        engine_ok[0] = False
        wait_until(lambda: probe(probes.port, "liveness") == not_serving, "not live")
        engine_ok[0] = redis_ok[0] = True
        wait_until(lambda: probe(probes.port, "liveness") == serving, "live again")
        assert probe(probes.port, "nonesuch") is None  # NOT_FOUND
    finally:
        server.stopped.set()
        probes.stop()
        server.grpc.stop(0)
