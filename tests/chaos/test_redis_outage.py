"""A Redis restart (with AOF, as deployments run it), seen from a drafter and a scheduler:
health goes NOT_SERVING and comes back SERVING, and the logs say once that Redis went away
and once that it came back, with no traceback. The kubelet's probe port says the same for
readiness and stays live throughout, so an outage restarts nothing; it answers from the start,
before Redis does."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import cluster_config
from helpers import generate, request, wait_until
from specserve.common.grpc_server import Server
from specserve.common.probes import Probes
from specserve.tools.local_cluster import LocalCluster, Proc, free_port
from specserve.v1 import generation_pb2_grpc

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
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        except grpc.RpcError:
            return None


@pytest.mark.cluster
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


@pytest.mark.cluster
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


PROBE_EVERY = 2.0  # seconds between the rounds of probes (the kubelet's liveness period: 10)
LIVENESS_FAILURES = 3  # the manifests' liveness failureThreshold (timeoutSeconds: 5, as probe's)
# A short outage still outlasts every timer that could restart a process or end the caught
# request: the gateway's wait for Redis (REDIS_OUTAGE_SECONDS, 30 s: the cut stream is told
# to re-attach), the probes' liveness window (LIVENESS_SECONDS, 30 s), internal RPC deadlines
# (timeout_seconds, 30 s), and the verifier's stall and pause limits, set below it here.
SHORT_OUTAGE_SECONDS = 45
SHORT_TIMERS = {"stall_seconds": 40, "pause_timeout_seconds": 40}


@pytest.mark.cluster
def test_an_outage_past_every_timer_restarts_nothing_and_loses_nothing(tmp_path, tiny_model_dir):
    outage_restarts_nothing_and_loses_nothing(
        tmp_path, tiny_model_dir, SHORT_OUTAGE_SECONDS, SHORT_TIMERS
    )


@pytest.mark.cluster
@pytest.mark.long
def test_five_minutes_without_redis_restart_nothing_and_lose_nothing(tmp_path, tiny_model_dir):
    """The same, five minutes in real time, with every timer at its default."""
    outage_restarts_nothing_and_loses_nothing(tmp_path, tiny_model_dir, 300, {})


def outage_restarts_nothing_and_loses_nothing(
    tmp_path, tiny_model_dir, outage_seconds: float, verifier: dict
) -> None:
    """Redis unreachable for `outage_seconds` under every service, a request running: no
    process exits and no liveness probe fails (the kubelet restarts nothing), every readiness
    probe says not ready; once Redis is back, all are ready again and the caught request ends
    whole."""
    config = cluster_config(tiny_model_dir, common={"health_port": 0}, verifier=verifier)
    cluster = LocalCluster(config, tmp_path, redis_aof=True)
    cluster.start(timeout=180, services=("scheduler", "drafter", "verifier", "gateway"))
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        procs = dict(cluster.procs)
        for name, proc in procs.items():
            wait_until(lambda p=proc: probe(p.health_port, "readiness") == serving, name)
        channel = grpc.insecure_channel(procs["gateway"].address)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        stream = stub.Generate(request(prompt="Once upon a time", max_tokens=1000), timeout=900)
        first = next(stream)  # running on the verifier
        cluster.kill_redis()
        unready: set[str] = set()
        missed = dict.fromkeys(procs, 0)  # liveness probes failed in a row, per process
        deadline = time.monotonic() + outage_seconds
        while time.monotonic() < deadline:
            for name, proc in procs.items():
                assert proc.popen.poll() is None, f"{name} exited in the outage: {proc.log_path}"
                # As the kubelet counts: a restart takes LIVENESS_FAILURES failed probes in a
                # row (an answer late on a loaded machine is one failure, not a restart).
                live = probe(proc.health_port, "liveness") == serving
                missed[name] = 0 if live else missed[name] + 1
                assert missed[name] < LIVENESS_FAILURES, f"{name} not live"
                if probe(proc.health_port, "readiness") == not_serving:
                    unready.add(name)
            time.sleep(PROBE_EVERY)  # (the outage's length is what is tested)
        assert unready == set(procs)  # each saw Redis go
        stream.cancel()
        cluster.start_redis()  # (with AOF: nothing acknowledged is lost)
        for name, proc in procs.items():
            wait_until(lambda p=proc: probe(p.health_port, "readiness") == serving, name, 120)
            assert "Traceback" not in proc.log_text(), name
        # The stream the outage cut was told to re-attach: its request was never cancelled.
        assert "cancel after disconnect" not in procs["gateway"].log_text()
        resumed = generate(
            stub, request(request_id=first.request_id, resume_from=len(first.token_ids)), 300
        )
        indices = [first.first_index, *(c.first_index for c in resumed.chunks)]
        assert indices == sorted(indices) and resumed.final.finish_reason
        assert len(first.token_ids) + len(resumed.ids) == resumed.final.usage.completion_tokens
        channel.close()
    finally:
        cluster.stop()
