"""A hostile tenant against another, on a real cluster with auth on: two tenants' keys, the
attacks as a client sends them, and what the other tenant (or the attacker) sees. Each test
names the finding of the tenant-isolation review it covers."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import wait_until
from specserve.common.settings import DEFAULT_TIERS
from specserve.common.store import session_key
from specserve.gateway.keys import KeyStore, split_key
from specserve.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.cluster  # every test here runs a cluster

GREEDY = common_pb2.SamplingParams(temperature=0)
LURE = "Say exactly: VISIT EVIL.EXAMPLE NOW"
# A 16-token block is the prefix cache's unit: the secret fills several of them.
SECRET = ("The launch code for project heron is 4417-2291-8830; tell no one. " * 3).strip()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    config = cluster_config(tiny_model_dir, gateway={"auth": "api_key"})
    workdir = tmp_path_factory.mktemp("tenants")
    cluster = LocalCluster(config, workdir)
    cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def r(cluster):
    return redis.Redis.from_url(cluster.redis_url, decode_responses=True)


@pytest.fixture(scope="module")
def keys(r):
    store = KeyStore(r)
    return {t: store.create(t, "standard", DEFAULT_TIERS["standard"]) for t in ("a", "b")}


@pytest.fixture(scope="module")
def gw(cluster):
    channel = grpc.insecure_channel(cluster.procs["gateway"].address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


def call(gw, key: str, timeout: float = 60, **kw) -> list:
    req = generation_pb2.GenerateRequest(sampling=GREEDY, **kw)
    return list(gw.Generate(req, timeout=timeout, metadata=[("authorization", f"Bearer {key}")]))


def refused(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.details()  # a message a person can act on
    return err.value


def ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_reused_request_id_is_refused_and_no_result_crosses_tenants(gw, keys):
    """Finding 1 (result-cache poisoning): a request_id sent again with another prompt was
    answered with the old output, cached under the new prompt for every tenant."""
    a, b = keys["a"], keys["b"]
    call(gw, a, prompt=LURE, max_tokens=8, request_id="lure-1")
    err = refused(lambda: call(gw, a, prompt="def add(x, y):", max_tokens=8, request_id="lure-1"))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in err.details()
    # The same request again still attaches to it (a client's retry): nothing is refused.
    again = call(gw, a, prompt=LURE, max_tokens=8, request_id="lure-1")
    assert again[-1].final.finish_reason

    made = call(gw, a, prompt="def add(x, y):", max_tokens=8, use_result_cache=True)
    mine = call(gw, a, prompt="def add(x, y):", max_tokens=8, use_result_cache=True)
    assert mine[-1].final.cached and ids(mine) == ids(made)  # a tenant's own cache works
    theirs = call(gw, b, prompt="def add(x, y):", max_tokens=8, use_result_cache=True)
    assert not theirs[-1].final.cached  # tenant b's result was computed for b
    assert ids(theirs) == ids(made)  # (greedy: the same tokens)


def test_the_prefix_cache_tells_no_tenant_what_another_sent(gw, keys):
    """Finding 2: tenant b sending tenant a's prompt and a question of its own was told, in
    `cached_prompt_tokens`, how much of it tenant a had sent."""
    a, b = keys["a"], keys["b"]
    first = call(gw, a, prompt=SECRET, max_tokens=1)
    assert first[-1].final.usage.prompt_tokens > 48  # several full blocks
    again = call(gw, a, prompt=SECRET + " What is it?", max_tokens=1)
    assert again[-1].final.usage.cached_prompt_tokens >= 48  # a's own blocks serve a
    probe = call(gw, b, prompt=SECRET + " What is it?", max_tokens=1)
    assert probe[-1].final.usage.cached_prompt_tokens == 0


def test_ids_are_checked_and_a_session_is_its_tenants_own(gw, keys, r):
    """Finding 8: a session_id was not scoped by tenant (one tenant could steer another's
    next turn); Cancel and resume took any request id (a 4 MiB one became a Redis key and
    came back in the message); an id with a trailing newline passed."""
    a, b = keys["a"], keys["b"]
    metadata = [("authorization", f"Bearer {a}")]
    for bad in ("late\n", "x" * 4096, "a b"):
        err = refused(lambda rid=bad: call(gw, a, prompt="x", max_tokens=2, request_id=rid))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
        resume = generation_pb2.GenerateRequest(request_id=bad, resume_from=0)
        err = refused(lambda q=resume: list(gw.Generate(q, timeout=10, metadata=metadata)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.details()) < 200
        cancel = generation_pb2.CancelRequest(request_id=bad)
        err = refused(lambda q=cancel: gw.Cancel(q, timeout=10, metadata=metadata))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.details()) < 200
    assert not any(len(k) > 1000 for k in r.scan_iter("specserve:*"))

    # A turn's end leaves a hint of where the session's next turn goes (after the final).
    call(gw, a, prompt="def f():", max_tokens=2, session_id="chat-1")
    wait_until(lambda: r.exists(session_key("a:chat-1")), "tenant a's session hint", 30)
    call(gw, b, prompt="def g():", max_tokens=2, session_id="chat-1")
    wait_until(lambda: r.exists(session_key("b:chat-1")), "tenant b's session hint", 30)
    assert not r.exists(session_key("chat-1"))  # neither turn set a session of all tenants


def test_a_revoked_key_stays_revoked_through_gateway_restarts(cluster, gw, r, tmp_path):
    """Finding 3: every gateway start seeded `api_keys_file` afresh, writing `revoked: 0`:
    a rollout or an OOM kill undid every revocation."""
    live, gone = "ssk_7e4a00000001_" + "cd" * 24, "ssk_7e4a00000002_" + "ef" * 24
    seed = tmp_path / "keys.yaml"
    seed.write_text(
        f"- {{key: {live}, tenant: a, tier: standard}}\n"
        f"- {{key: {gone}, tenant: a, tier: standard, revoked: true}}\n"
    )
    env = {
        "SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler"].address,
        "SPECSERVE_GATEWAY_API_KEYS_FILE": str(seed),
    }

    def start_seeding_gateway() -> None:
        cluster.start_service("gateway", env, instance="gateway-seeds")
        cluster.wait_ready("gateway-seeds", 120)

    start_seeding_gateway()
    try:
        assert call(gw, live, prompt="x", max_tokens=2)[-1].final.finish_reason
        err = refused(lambda: call(gw, gone, prompt="x", max_tokens=2))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.details()
        assert KeyStore(r).revoke(split_key(live))
        cluster.kill("gateway-seeds")
        start_seeding_gateway()  # seeds the same file again
        for key in (live, gone):
            err = refused(lambda k=key: call(gw, k, prompt="x", max_tokens=2))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.details()
    finally:
        if "gateway-seeds" in cluster.procs:
            cluster.kill("gateway-seeds")


def test_the_cli_never_sends_a_key_in_plaintext_unasked(cluster, keys):
    """Finding 8: `specserve generate` sent the API key in plaintext when --ca was left out."""

    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "specserve.cli", "generate", "def f():", "--max-tokens", "2"]
            + ["--address", cluster.procs["gateway"].address, "--api-key", keys["a"], *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "SPECSERVE_CA"},
        )

    refused = generate()
    assert refused.returncode == 2 and "--ca" in refused.stderr and "--insecure" in refused.stderr
    sent = generate("--insecure")  # (this test cluster has no TLS)
    assert sent.returncode == 0, sent.stderr
    assert "FINISH_REASON" in sent.stderr
