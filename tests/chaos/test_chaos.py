"""Chaos: the whole cluster (2 verifiers, 2 drafters, a private Redis with AOF) serves a stream
of concurrent greedy requests; in the middle one part is killed. Clients re-attach with
`resume_from` when their stream breaks. Nothing may be lost: every request ends, every index
arrives exactly once, and every output equals the undisturbed greedy output."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import cluster_config
from helpers import Client, request, wait_until
from specserve.store import ENDED, GROUP, QUEUE_CLASSES, RequestStore, queue_key
from specserve.tools.local_cluster import LocalCluster, free_port
from specserve.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.cluster  # every test here runs a cluster

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\nfor root, dirs, files in",
    "SELECT name FROM users WHERE",
    "fn main() {\n    let v = vec![",
    "# Sort a list of numbers\nnumbers = [5, 3, 8",
]
MAX_TOKENS = 400
REQUESTS = 12  # more than the 8 batch slots: some wait in the queue when the kill comes


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, tiny_model_dir):
    config = cluster_config(
        tiny_model_dir,
        scheduler={"dead_verifier_grace_seconds": 0.5},
        verifier={"speculative_decoding": True, "draft_timeout_seconds": 1.0},
        # The draft model's trees, not the default hybrid's: suffix drafts of the tiny model's
        # repetitive output would finish a request in a few deep steps, before the kills,
        # drains and deadlines these tests aim at its middle could land.
        drafter={"proposer": "draft_model"},
    )
    cluster = LocalCluster(config, tmp_path_factory.mktemp("chaos"), redis_aof=True)
    cluster.start(timeout=180, gateway_port=free_port())
    try:
        cluster.start_service("drafter", instance="drafter-2")
        start_verifier(cluster, "verifier-2")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def store(chaos):
    return RequestStore.from_url(chaos.redis_url)


@pytest.fixture(scope="module")
def expected(tiny_model, tokenizer):
    """The undisturbed greedy output of each prompt."""
    return {p: hf_greedy(tiny_model, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS}


def start_verifier(cluster: LocalCluster, key: str) -> None:
    drafter = cluster.procs["drafter"].address if "drafter" in cluster.procs else ""
    env = {"SPECSERVE_VERIFIER_DRAFTER_ADDRESSES": f'["{drafter}"]'} if drafter else {}
    cluster.start_service("verifier", env, instance=key)
    cluster.wait_ready(key, 120)


def restart(cluster: LocalCluster, key: str, port: int = 0) -> None:
    name = key.split("-")[0]
    env = {}
    if name == "gateway":
        env["SPECSERVE_GATEWAY_SCHEDULER_ADDRESS"] = cluster.procs["scheduler"].address
    if name == "verifier":
        start_verifier(cluster, key)
        return
    cluster.start_service(name, env, port=port, instance=key)
    cluster.wait_ready(key, 120)


def wait_health(cluster: LocalCluster, status, timeout: float = 10) -> None:
    """Waits until every service (each needs Redis) reports `status` on grpc.health.v1."""
    keys = list(cluster.procs)
    deadline = time.monotonic() + timeout
    while True:
        seen = {}
        for key in keys:
            with grpc.insecure_channel(cluster.procs[key].address) as channel:
                seen[key] = (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=5)
                    .status
                )
        if all(v == status for v in seen.values()):
            return
        assert time.monotonic() < deadline, f"health after {timeout}s: {seen}"
        time.sleep(0.1)


def busiest_verifier(cluster: LocalCluster, store: RequestStore) -> str:
    keys = [k for k in cluster.procs if k.startswith("verifier")]
    return max(keys, key=lambda k: len(store.owned(cluster.procs[k].address)))


def kill_and_restart(kind: str):
    """What a scenario does to the cluster at the kill moment; returns what to restore after
    the workload (None if it restored already)."""

    def act(cluster: LocalCluster, store: RequestStore):
        if kind == "verifier":
            key = busiest_verifier(cluster, store)
            cluster.kill(key)
            return lambda: restart(cluster, key)
        if kind == "drafter":
            cluster.kill("drafter")
            return lambda: restart(cluster, "drafter")
        if kind == "redis":
            cluster.kill_redis()
            wait_health(cluster, health_pb2.HealthCheckResponse.NOT_SERVING)
            cluster.start_redis()
            return None
        name, _, how = kind.partition("-")  # scheduler, gateway[-sigterm]: same port again
        port = cluster.procs[name].port
        code = cluster.kill(name, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        assert how != "sigterm" or code == 0  # drained, then exited cleanly
        restart(cluster, name, port)
        return None

    return act


def run_workload(cluster, store, expected, tokenizer, name: str, act) -> dict:
    address = cluster.procs["gateway"].address
    clients = [
        Client(f"chaos-{name}-{i}", tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids, MAX_TOKENS)
        for i in range(REQUESTS)
    ]
    threads = [threading.Thread(target=c.run, args=(address,), daemon=True) for c in clients]
    for t in threads:
        t.start()
        time.sleep(0.05)
    wait_until(lambda: sum(c.received >= 8 for c in clients) >= 4, "4 streams under way", 60)
    in_flight = [c for c in clients if c.received and c.final is None]  # streaming now
    killed_at = time.monotonic()
    restore = act(cluster, store)
    for t in threads:
        t.join(timeout=300)
    if restore:
        restore()
    return report(name, clients, in_flight, killed_at, store, expected, tokenizer)


def report(name, clients, in_flight, killed_at, store, expected, tokenizer) -> dict:
    lost = duplicates = wrong = 0
    for c in clients:
        indices = c.indices()
        duplicates += len(indices) - len(set(indices))
        total = c.final.usage.completion_tokens if c.final else len(set(indices))
        missing = set(range(total)) - set(indices)
        lost += len(missing)
        prompt = tokenizer.decode(c.prompt_ids)
        wrong += c.ids() != expected[prompt]
    pauses = [longest_pause(c, killed_at) for c in in_flight]
    row = {
        "scenario": name,
        "requests": len(clients),
        "completed": sum(c.final is not None for c in clients),
        "resumed": sum(c.reattached > 0 for c in clients),
        "requeued": sum(store.get(c.rid).requeues for c in clients),
        "tokens lost": lost,
        "duplicates": duplicates,
        "wrong outputs": wrong,
        "recovery s": round(max(pauses, default=0.0), 2),
        "errors": [c.error for c in clients if c.error],
        "pending": sum(
            int(store.r.xpending(queue_key(q), GROUP)["pending"]) for q in QUEUE_CLASSES
        ),
    }
    print(
        "\n"
        + " | ".join(f"{k}: {v}" for k, v in row.items() if k != "errors")
        + (f" | errors: {row['errors']}" if row["errors"] else "")
    )
    return row


def longest_pause(client: Client, killed_at: float) -> float:
    """The longest wait for a token the client had after the kill (or across it)."""
    times = sorted([killed_at] + [at for at, _, _ in client.arrivals])
    return max((b - a for a, b in zip(times, times[1:], strict=False) if b > killed_at), default=0)


def assert_nothing_lost(row: dict) -> None:
    assert row["errors"] == []
    assert row["completed"] == row["requests"]
    assert row["tokens lost"] == 0
    assert row["duplicates"] == 0
    assert row["wrong outputs"] == 0
    assert row["pending"] == 0


@pytest.mark.parametrize(
    "kind", ["verifier", "drafter", "scheduler", "gateway", "gateway-sigterm", "redis"]
)
def test_killing_one_part_loses_nothing(chaos, store, expected, tokenizer, kind):
    row = run_workload(chaos, store, expected, tokenizer, kind, kill_and_restart(kind))
    assert_nothing_lost(row)
    if kind == "verifier":
        assert row["requeued"] > 0  # taken over by the other verifier
    if kind.startswith("gateway"):  # the clients whose stream broke re-attached; a drain
        assert row["resumed"] > 0  # cancels nothing
    if kind == "redis":  # NOT_SERVING while it was away (waited for), SERVING again after
        wait_health(chaos, health_pb2.HealthCheckResponse.SERVING)
    assert all(not store.owned(v) for v in store.owners())


def test_sigterm_drains_a_verifier_with_no_failed_request(chaos, store, expected, tokenizer):
    codes = []

    def act(cluster, store):
        key = busiest_verifier(cluster, store)
        codes.append(cluster.kill(key, signal.SIGTERM))  # waits for the exit
        return lambda: restart(cluster, key)

    row = run_workload(chaos, store, expected, tokenizer, "verifier-sigterm", act)
    assert codes == [0]
    assert row["requeued"] > 0  # what did not finish within the grace period was handed back
    assert_nothing_lost(row)


def verifier_stubs(cluster):
    return [
        verifier_pb2_grpc.VerifierServiceStub(grpc.insecure_channel(p.address))
        for k, p in cluster.procs.items()
        if k.startswith("verifier")
    ]


def wait_until_gone(stubs, rid: str, timeout: float = 10) -> int:
    """Waits until no verifier runs `rid`; returns the steps the verifiers took meanwhile."""
    before = sum(s.Status(verifier_pb2.StatusRequest(), timeout=5).steps for s in stubs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = [s.Status(verifier_pb2.StatusRequest(), timeout=5) for s in stubs]
        if all(rid not in st.request_ids for st in status):
            return sum(st.steps for st in status) - before
        time.sleep(0.005)
    raise AssertionError(f"{rid} still runs {timeout}s later")


def test_cancel_frees_the_slot_within_a_step_or_two(chaos, tokenizer):
    stubs = verifier_stubs(chaos)
    with grpc.insecure_channel(chaos.procs["gateway"].address) as channel:
        gateway = generation_pb2_grpc.GenerationServiceStub(channel)
        req = request(prompt_ids=tokenizer(PROMPTS[0]).input_ids, max_tokens=1000)
        req.request_id = "chaos-cancel"
        stream = gateway.Generate(req, timeout=60)
        next(stream)
        gateway.Cancel(generation_pb2.CancelRequest(request_id="chaos-cancel"), timeout=10)
        steps = wait_until_gone(stubs, "chaos-cancel")
        print(f"\ncancel: the sequence left the batch after {steps} verifier step(s)")
        assert steps <= 3
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.CANCELLED


def wait_ended(store: RequestStore, rid: str, timeout: float = 15, missing_ok: bool = False):
    """The request's record once it has ended; with `missing_ok`, None if no record of it
    appears at all within `timeout`."""
    deadline = time.monotonic() + timeout
    rec = None
    while time.monotonic() < deadline:
        rec = store.get(rid)
        if rec is not None and rec.status in ENDED:
            return rec
        time.sleep(0.05)
    if rec is None and missing_ok:
        return None
    raise AssertionError(f"{rid} did not end within {timeout}s")


def test_a_passed_deadline_stops_the_work_and_reports_deadline_exceeded(chaos, store, tokenizer):
    ids = tokenizer(PROMPTS[1]).input_ids
    # The client's own deadline: it gets DEADLINE_EXCEEDED and the work stops.
    with grpc.insecure_channel(chaos.procs["gateway"].address) as channel:
        gateway = generation_pb2_grpc.GenerationServiceStub(channel)
        req = request(prompt_ids=ids, max_tokens=1000)
        req.request_id = "chaos-client-deadline"
        with pytest.raises(grpc.RpcError) as err:
            list(gateway.Generate(req, timeout=1.0))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # (None: the deadline passed before the gateway had submitted it: no work was started.)
    rec = wait_ended(store, "chaos-client-deadline", missing_ok=True)
    assert rec is None or rec.status in ("cancelled", "expired")
    wait_until_gone(verifier_stubs(chaos), "chaos-client-deadline")
    # The deadline travels with the request: the verifier ends it by itself when it passes,
    # and whoever re-attaches is told DEADLINE_EXCEEDED.
    with grpc.insecure_channel(chaos.procs["scheduler"].address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        scheduler.Submit(
            scheduler_pb2.SubmitRequest(
                request_id="chaos-deadline",
                prompt_ids=ids,
                # Far more than the 2 s allow: one token a step (speculating, the tiny model's
                # repetitive output came out 1,000 tokens in under 3 s; plainly, 1,253 in 3 s).
                max_tokens=2000,
                speculation=common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF),
                priority=common_pb2.PRIORITY_CLASS_INTERACTIVE,
                # Room to be placed and prefilled on a loaded machine before it passes.
                deadline_unix_ms=int(time.time() * 1000) + 2000,
            ),
            timeout=10,
        )
    rec = wait_ended(store, "chaos-deadline")
    assert rec.status == "expired" and 0 < rec.generated < 2000
    wait_until_gone(verifier_stubs(chaos), "chaos-deadline")
    with grpc.insecure_channel(chaos.procs["gateway"].address) as channel:
        gateway = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(
                gateway.Generate(
                    generation_pb2.GenerateRequest(request_id="chaos-deadline", resume_from=0),
                    timeout=10,
                )
            )
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_service_started_before_redis_waits_for_it(tmp_path):
    cluster = LocalCluster(cluster_config(None), tmp_path)
    cluster.redis_port = free_port()
    cluster.config["common"]["redis_url"] = f"redis://127.0.0.1:{cluster.redis_port}/0"
    cluster.config_path.write_text(yaml.safe_dump(cluster.config))
    try:
        scheduler = cluster.start_service("scheduler", wait=False)
        waiting = lambda: "redis unreachable; waiting" in scheduler.log_text()  # noqa: E731
        wait_until(waiting, "the scheduler waiting for Redis", 60)
        cluster.start_redis()  # (only once it is seen waiting)
        cluster.wait_ready("scheduler", 60)

        def serving() -> bool:
            with grpc.insecure_channel(scheduler.address) as channel:
                request = health_pb2.HealthCheckRequest()
                status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
            return status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, "the scheduler serving once Redis is up", 30)
    finally:
        cluster.stop()
