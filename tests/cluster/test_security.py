"""API keys, tenants, tier limits, quotas shared by two gateways, and the audit trail, on a
real cluster with auth on."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import cluster_config, tls_cluster_config
from helpers import request
from specserve.common.settings import DEFAULT_TIERS, Tier
from specserve.common.tls import make_dev_certs
from specserve.gateway.keys import KeyStore, QuotaExceeded
from specserve.store import AUDIT_STREAM, STREAM_MAX_AGE_MS, now_ms, quota_keys
from specserve.tools.local_cluster import ClusterError, LocalCluster
from specserve.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

SECRET_PROMPT = "zebra quokka marmalade"  # must never show up in a log or the audit trail
REDIS_PASSWORD = "redis-" + secrets.token_hex(12)  # nor this, nor in the process list


SEEDED_KEY = "ssk_5eed00000001_" + "ab" * 24


@pytest.fixture(scope="module")
def secure(tmp_path_factory, tiny_model_dir):
    config = cluster_config(tiny_model_dir, gateway={"auth": "api_key"})
    workdir = tmp_path_factory.mktemp("secure")
    cluster = LocalCluster(config, workdir, redis_password=REDIS_PASSWORD)
    cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
    try:
        seed = workdir / "keys.yaml"  # as a mounted Secret would hold them
        seed.write_text(f"- {{key: {SEEDED_KEY}, tenant: seeded, tier: free}}\n")
        env = {
            "SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler"].address,
            "SPECSERVE_GATEWAY_API_KEYS_FILE": str(seed),
        }
        cluster.start_service("gateway", env, instance="gateway-2")
        cluster.wait_ready("gateway-2", 120)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def keys(secure):
    return KeyStore(redis.Redis.from_url(secure.redis_url, decode_responses=True))


def stub(cluster, gateway: str = "gateway"):
    channel = grpc.insecure_channel(cluster.procs[gateway].address)
    return generation_pb2_grpc.GenerationServiceStub(channel)


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def generate(gw, key: str, timeout: float = 60, **kw):
    return list(gw.Generate(request(**kw), timeout=timeout, metadata=auth(key)))


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.details()  # a message a person can act on
    return err.value


def cli(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.tools.cli",
            "keys",
            "--redis-url",
            cluster.redis_url,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.cluster
def test_a_call_needs_a_valid_live_key(secure, keys):
    gw = stub(secure)
    made = cli(secure, "create", "--tenant", "acme", "--tier", "standard")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    key_id = key.split("_")[1]
    assert len(generate(gw, key, prompt="def f():", max_tokens=3)) >= 2
    wrong_secret = key[: key.rindex("_") + 1] + "x" * 48
    for metadata in (
        [],
        [("authorization", key)],  # no scheme
        auth("not-a-key"),
        auth("ssk_000000000000_" + "y" * 48),  # an id nobody has
        auth(wrong_secret),
    ):
        err = rpc_error(lambda m=metadata: list(gw.Generate(request(prompt="x"), metadata=m)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    err = rpc_error(lambda: gw.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    listed = cli(secure, "list")
    assert key_id in listed.stdout and "acme" in listed.stdout and key not in listed.stdout
    assert cli(secure, "revoke", key_id).returncode == 0
    err = rpc_error(lambda: generate(gw, key, prompt="x", max_tokens=2))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.details()
    assert cli(secure, "revoke", "nosuchkey").returncode == 1


@pytest.mark.cluster
def test_keys_seeded_from_a_file_at_start_work_on_every_gateway(secure, keys):
    out = generate(stub(secure), SEEDED_KEY, prompt="x", max_tokens=2)  # seeded by gateway-2
    assert out[-1].HasField("final")
    assert any(k["id"] == "5eed00000001" and k["tenant"] == "seeded" for k in keys.list())


@pytest.mark.cluster
def test_the_redis_password_is_in_no_log_or_process_list(secure):
    assert f":{REDIS_PASSWORD}@" in secure.redis_url  # the cluster uses it
    for proc in secure.procs.values():
        assert REDIS_PASSWORD not in proc.log_text()
        cmdline = Path(f"/proc/{proc.popen.pid}/cmdline").read_bytes().decode(errors="replace")
        assert REDIS_PASSWORD not in cmdline
    redis_cmdline = Path(f"/proc/{secure.redis.pid}/cmdline").read_bytes().decode()
    assert REDIS_PASSWORD not in redis_cmdline
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=secure.redis_port, password="wrong").ping()


@pytest.mark.cluster
def test_keys_are_stored_hashed_only(secure, keys):
    key = keys.create("hashed", "standard", DEFAULT_TIERS["standard"])
    r = redis.Redis.from_url(secure.redis_url, decode_responses=True)
    for name in r.scan_iter("specserve:apikey*"):
        values = r.hgetall(name) if r.type(name) == "hash" else {"m": " ".join(r.smembers(name))}
        assert all(key not in v and key.split("_")[2] not in v for v in values.values())


@pytest.mark.cluster
def test_a_tier_bounds_what_a_key_may_ask(secure, keys):
    gw = stub(secure)
    free = keys.create("small", "free", DEFAULT_TIERS["free"])
    err = rpc_error(
        lambda: generate(
            gw, free, prompt="x", max_tokens=2, priority=common_pb2.PRIORITY_CLASS_BATCH
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "batch" in err.details()
    err = rpc_error(lambda: generate(gw, free, prompt="x", max_tokens=513))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "max_tokens" in err.details()
    # Without max_tokens, the default is capped at the tier's.
    final = generate(gw, free, prompt="x", timeout=120)[-1].final
    assert final.usage.completion_tokens <= 512


@pytest.mark.cluster
def test_a_tenant_never_sees_another_tenants_request(secure, keys, tokenizer):
    gw = stub(secure)
    a = keys.create("tenant-a", "standard", DEFAULT_TIERS["standard"])
    b = keys.create("tenant-b", "standard", DEFAULT_TIERS["standard"])
    mine = generate(gw, a, prompt="def alpha():", max_tokens=6, request_id="same-id")
    ids_a = [t for c in mine for t in c.token_ids]
    resume = generation_pb2.GenerateRequest(request_id="same-id", resume_from=0)
    err = rpc_error(lambda: list(gw.Generate(resume, timeout=10, metadata=auth(b))))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    cancel = generation_pb2.CancelRequest(request_id="same-id")
    err = rpc_error(lambda: gw.Cancel(cancel, timeout=10, metadata=auth(b)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    # The same id from tenant b is b's own request: b gets its output, a keeps its own.
    theirs = generate(gw, b, prompt="class Beta:", max_tokens=6, request_id="same-id")
    assert theirs[0].request_id == "same-id"
    again = list(gw.Generate(resume, timeout=10, metadata=auth(a)))
    assert [t for c in again for t in c.token_ids] == ids_a


@pytest.mark.cluster
def test_the_request_rate_is_shared_by_two_gateways(secure, keys):
    gw1, gw2 = stub(secure), stub(secure, "gateway-2")
    key = keys.create("limited", "standard", Tier(requests_per_minute=3))
    generate(gw1, key, prompt="a", max_tokens=2)
    generate(gw2, key, prompt="b", max_tokens=2)
    generate(gw1, key, prompt="c", max_tokens=2)
    with pytest.raises(grpc.RpcError) as err:
        generate(gw2, key, prompt="d", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests per minute" in err.value.details()
    retry = dict(err.value.trailing_metadata())["retry-after-ms"]
    assert 0 < int(retry) <= 20_000  # one request comes back every 20 s


@pytest.mark.cluster
def test_tokens_per_minute_count_prompt_and_output(secure, keys):
    gw = stub(secure)
    key = keys.create("tokens", "standard", Tier(tokens_per_minute=60))
    err = rpc_error(lambda: generate(gw, key, prompt="x", max_tokens=100))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tokens" in err.details()
    prompt = list(range(100, 145))  # 45 prompt tokens: they count whatever is generated
    generate(gw, key, prompt_ids=prompt, max_tokens=5)  # takes 50 of 60
    err = rpc_error(lambda: generate(gw, key, prompt_ids=prompt, max_tokens=5))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens per minute" in err.details()


@pytest.mark.cluster
def test_a_client_that_opens_streams_and_never_reads_them_is_capped(secure, keys):
    gw = stub(secure)
    key = keys.create("hoarder", "standard", Tier(concurrent_streams=2))
    held = [
        gw.Generate(request(prompt="def x():", max_tokens=1000), timeout=60, metadata=auth(key))
        for _ in range(2)
    ]
    for call in held:
        next(call)  # open, then never read again
    err = rpc_error(lambda: generate(gw, key, prompt="x", max_tokens=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams" in err.details()
    other = keys.create("bystander", "standard", DEFAULT_TIERS["standard"])
    assert generate(gw, other, prompt="x", max_tokens=2)[-1].HasField("final")
    held[0].cancel()
    deadline = time.monotonic() + 10
    while True:  # the slot comes back once the gateway sees the stream end
        try:
            generate(gw, key, prompt="x", max_tokens=2)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline
            time.sleep(0.2)
    held[1].cancel()


def test_the_stream_cap_holds_exactly_at_thousands_of_streams(redis_store):
    """The cap's script, at the scale of one gateway's streams: 2,000 slots taken by 8
    gateways' worth of threads at once out of 2,600 tries, not one more; each slot given back
    frees exactly one."""
    keys = KeyStore(redis_store.r)
    cap = 2000
    limits = Tier(concurrent_streams=cap, requests_per_minute=10**6, tokens_per_minute=10**9)
    who = keys.authenticate(keys.create("many", "standard", limits))

    def open_streams(ids: range) -> tuple[list[str], list[int]]:
        taken, refused = [], []
        for i in ids:
            try:
                keys.admit(who, f"s{i}", new_request=False)
                taken.append(f"s{i}")
            except QuotaExceeded as e:
                refused.append(e.retry_after_ms)
        return taken, refused

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(open_streams, [range(t, 2600, 8) for t in range(8)]))
    taken = [s for ok, _ in results for s in ok]
    refused = [ms for _, no in results for ms in no]
    assert len(taken) == cap and len(refused) == 2600 - cap
    assert all(ms >= 0 for ms in refused)
    streams = quota_keys(who.key_id)[1]
    assert redis_store.r.zcard(streams) == cap
    keys.release(who, taken[0])
    again, refused_again = open_streams(range(5000, 5002))
    assert again == ["s5000"] and len(refused_again) == 1  # the one slot given back, no more
    for stream in taken[1:] + again:
        keys.release(who, stream)
    assert redis_store.r.zcard(streams) == 0


def test_a_stream_open_past_the_slot_age_still_counts_while_its_gateway_lives(redis_store):
    """A gateway touches its open streams' slots (every STREAM_TOUCH_SECONDS): a stream open
    for longer than STREAM_MAX_AGE_MS (long reasoning) keeps its slot; a dead gateway's
    slot, not touched, ages out; a slot given back is not taken again by a touch."""
    keys = KeyStore(redis_store.r)
    who = keys.authenticate(keys.create("long", "standard", Tier(concurrent_streams=2)))
    streams = quota_keys(who.key_id)[1]
    keys.admit(who, "alive", new_request=False)
    keys.admit(who, "dead-gateway", new_request=False)
    opened_long_ago = now_ms() - STREAM_MAX_AGE_MS - 1
    redis_store.r.zadd(streams, {"alive": opened_long_ago, "dead-gateway": opened_long_ago})
    keys.touch([(who.key_id, "alive")])  # (its gateway's loop does this)
    keys.admit(who, "new", new_request=False)  # the dead gateway's slot aged out
    with pytest.raises(QuotaExceeded):  # the long stream's did not
        keys.admit(who, "one-too-many", new_request=False)
    assert set(redis_store.r.zrange(streams, 0, -1)) == {"alive", "new"}
    keys.release(who, "new")
    keys.touch([(who.key_id, "alive"), (who.key_id, "new")])
    assert redis_store.r.zrange(streams, 0, -1) == ["alive"]


@pytest.mark.cluster
def test_the_audit_trail_has_every_call_and_no_text(secure, keys):
    gw = stub(secure)
    key = keys.create("audited", "standard", DEFAULT_TIERS["standard"])
    out = generate(gw, key, prompt=SECRET_PROMPT, max_tokens=5, request_id="audit-1")
    text = "".join(c.text for c in out)
    rpc_error(lambda: list(gw.Generate(request(prompt=SECRET_PROMPT), timeout=10)))
    r = redis.Redis.from_url(secure.redis_url, decode_responses=True)
    deadline = time.monotonic() + 10
    while not (rows := [f for _, f in r.xrange(AUDIT_STREAM) if f["request_id"] == "audit-1"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    row = rows[0]
    assert row["tenant"] == "audited" and row["status"] == "FINISH_REASON_LENGTH"
    assert row["output_tokens"] == "5" and int(row["prompt_tokens"]) > 0
    assert row["client"] and float(row["duration_ms"]) > 0
    assert any(f["status"] == "UNAUTHENTICATED" for _, f in r.xrange(AUDIT_STREAM))
    stored = " ".join(" ".join(f.values()) for _, f in r.xrange(AUDIT_STREAM))
    logs = " ".join(p.log_text() for p in secure.procs.values())
    assert '"msg": "audit"' in logs
    for haystack in (stored, logs):
        assert SECRET_PROMPT not in haystack and "quokka" not in haystack
        assert not text.strip() or text not in haystack


# --- TLS and mTLS ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, tiny_model_dir, certs):
    cluster = LocalCluster(
        tls_cluster_config(tiny_model_dir, certs), tmp_path_factory.mktemp("tls")
    )
    cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
    yield cluster
    cluster.stop()


def health(channel, timeout: float = 5):
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=timeout
    )


@pytest.mark.cluster
def test_the_gateway_speaks_tls_and_internal_services_mtls(tls_cluster, certs, tmp_path):
    ca = certs["ca"].read_bytes()
    gateway, scheduler = (
        tls_cluster.procs["gateway"].address,
        tls_cluster.procs["scheduler"].address,
    )
    with grpc.secure_channel(gateway, grpc.ssl_channel_credentials(ca)) as channel:
        out = list(
            generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                request(prompt="def f():", max_tokens=3), timeout=60
            )
        )  # gateway -> scheduler -> verifier all went over mTLS for this
        assert out[-1].final.usage.completion_tokens == 3
    other_ca = make_dev_certs(tmp_path / "other")
    with grpc.insecure_channel(gateway) as channel:  # plaintext to a TLS port
        assert rpc_error(lambda: health(channel)).code() == grpc.StatusCode.UNAVAILABLE
    untrusted = grpc.ssl_channel_credentials(other_ca["ca"].read_bytes())
    with grpc.secure_channel(gateway, untrusted) as channel:  # the wrong CA
        assert rpc_error(lambda: health(channel)).code() == grpc.StatusCode.UNAVAILABLE
    name = (("grpc.ssl_target_name_override", "scheduler.specserve.internal"),)
    no_cert = grpc.ssl_channel_credentials(ca)
    with grpc.secure_channel(scheduler, no_cert, options=name) as channel:
        assert rpc_error(lambda: health(channel)).code() == grpc.StatusCode.UNAVAILABLE
    foreign = grpc.ssl_channel_credentials(
        ca, other_ca["client-key"].read_bytes(), other_ca["client"].read_bytes()
    )
    with grpc.secure_channel(scheduler, foreign, options=name) as channel:
        assert rpc_error(lambda: health(channel)).code() == grpc.StatusCode.UNAVAILABLE
    client = grpc.ssl_channel_credentials(
        ca, certs["client-key"].read_bytes(), certs["client"].read_bytes()
    )
    with grpc.secure_channel(scheduler, client, options=name) as channel:
        assert health(channel).status == health_pb2.HealthCheckResponse.SERVING


def dial(address: str, certs, who: str, peer: str) -> grpc.Channel:
    """A channel to `peer`'s service at `address` with `who`'s certificate of `certs`."""
    ca, key, cert = (certs[n].read_bytes() for n in ("ca", f"{who}-key", who))
    name = (("grpc.ssl_target_name_override", f"{peer}.specserve.internal"),)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=name)


@pytest.mark.cluster
def test_each_internal_service_takes_calls_only_from_the_services_that_make_them(
    tls_cluster, certs
):
    """Finding 9 of the tenant-isolation review: every service's certificate carried the
    same name and both usages, and no server asked who called: a drafter's (or a verifier's)
    certificate could call the scheduler's Submit as any tenant."""
    scheduler = tls_cluster.procs["scheduler"].address
    verifier = tls_cluster.procs["verifier"].address
    forged = scheduler_pb2.SubmitRequest(
        request_id="victim:forged", prompt_ids=[1, 2], max_tokens=2, tenant="victim"
    )
    with dial(scheduler, certs, "verifier", "scheduler") as channel:
        err = rpc_error(lambda: scheduler_pb2_grpc.SchedulerServiceStub(channel).Submit(forged))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "verifier" in err.details()
        assert health(channel).status == health_pb2.HealthCheckResponse.SERVING  # (any cert)
    with dial(scheduler, certs, "drafter", "scheduler") as channel:
        err = rpc_error(lambda: scheduler_pb2_grpc.SchedulerServiceStub(channel).Submit(forged))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "drafter" in err.details()
    with dial(verifier, certs, "client", "verifier") as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        err = rpc_error(lambda: stub.Cancel(verifier_pb2.VerifierServiceCancelRequest()))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.Status(verifier_pb2.StatusRequest(), timeout=10).model_version  # (doctor's)
    with dial(scheduler, certs, "client", "verifier") as channel:  # a name it does not carry
        assert rpc_error(lambda: health(channel)).code() == grpc.StatusCode.UNAVAILABLE
    assert not redis.Redis.from_url(tls_cluster.redis_url).exists("specserve:req:victim:forged")


@pytest.mark.cluster
def test_a_service_without_certificates_refuses_to_start_in_plaintext(tmp_path):
    config = cluster_config(None, common={"insecure": False})
    cluster = LocalCluster(config, tmp_path)
    try:
        with pytest.raises(ClusterError) as err:
            cluster.start(timeout=60, services=("scheduler",))
        assert "specserve certs dev" in str(err.value) and "insecure" in str(err.value)
    finally:
        cluster.stop()
