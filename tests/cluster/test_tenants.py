"""A hostile tenant against another, on a real cluster with auth on: two tenants' keys, the
attacks as a client sends them, and what the other tenant (or the attacker) sees. Each test
names the finding of the tenant-isolation review it covers."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import scrape, wait_until
from specserve.common.settings import DEFAULT_TIERS
from specserve.gateway.keys import KeyStore, split_key
from specserve.store import KEY_IDS, RequestStore, key_record, quota_keys, session_key
from specserve.store.acl import SERVICES
from specserve.tools.local_cluster import LocalCluster
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
    cluster = LocalCluster(config, workdir, redis_users=True)  # each service its own user
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
            [
                sys.executable,
                "-m",
                "specserve.tools.cli",
                "generate",
                "def f():",
                "--max-tokens",
                "2",
            ]
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


def free_key(r) -> str:
    """A new key of the free tier (2 streams, 20 requests a minute), for one test."""
    return KeyStore(r).create("c", "free", DEFAULT_TIERS["free"])


@pytest.fixture
def guarded(cluster):
    """Another gateway of the cluster: 8 calls in flight at most, and 2 s for a call's
    request to follow its headers."""
    env = {
        "SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler"].address,
        "SPECSERVE_GATEWAY_MAX_CONCURRENT_RPCS": "8",
        "SPECSERVE_GATEWAY_FIRST_MESSAGE_TIMEOUT_SECONDS": "2",
        "SPECSERVE_GATEWAY_METRICS_PORT": "0",
    }
    cluster.start_service("gateway", env, instance="gateway-guarded")
    try:
        yield cluster.wait_ready("gateway-guarded", 120)
    finally:
        cluster.kill("gateway-guarded")


async def _headers_only(channel, key: str | None, n: int) -> list:
    """n Generate calls that send their headers and never their request."""
    method = channel.stream_stream(
        "/specserve.v1.GenerationService/Generate",
        request_serializer=generation_pb2.GenerateRequest.SerializeToString,
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )
    never = asyncio.Event()

    async def nothing():
        await never.wait()
        yield generation_pb2.GenerateRequest()

    metadata = [("authorization", f"Bearer {key}")] if key else []
    return [method(nothing(), metadata=metadata, timeout=60) for _ in range(n)]


def test_headers_without_a_request_hold_no_slots_of_anyone_else(guarded, keys, r):
    """Finding 4: gRPC counted a call against max_concurrent_rpcs once its headers came, and
    the key was read only with the message: a client without a key that sent headers and
    never a message held every slot, for as long as it liked."""
    b, c = keys["b"], free_key(r)

    async def attack() -> None:
        async with grpc.aio.insecure_channel(guarded.address) as channel:
            for _ in range(5):  # 20 in all, 4 at a time (C-core's backlog takes 8 at most)
                for each in await _headers_only(channel, None, 4):  # each answered at once
                    code = await asyncio.wait_for(each.code(), 10)
                    assert code == grpc.StatusCode.UNAUTHENTICATED
            # With a key: at most its own share waits (the free tier: 2), for 2 s.
            keyed = await _headers_only(channel, c, 6)
            started = time.monotonic()
            codes = [await asyncio.wait_for(each.code(), 10) for each in keyed]
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4, codes
            assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 2, codes
            assert time.monotonic() - started < 8
            held = await _headers_only(channel, c, 2)  # (held while tenant b calls)
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.GenerateRequest(prompt="x", max_tokens=2, sampling=GREEDY)
            metadata = [("authorization", f"Bearer {b}")]
            chunks = [c async for c in stub.Generate(request, metadata=metadata, timeout=60)]
            assert chunks[-1].final.finish_reason
            for each in held:
                each.cancel()

    asyncio.run(attack())


def _send(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


def _status(sock: socket.socket) -> int:
    head = sock.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 "), head[:200]
    return int(head.split()[1])


def test_a_body_that_never_comes_holds_a_bounded_share_of_http(guarded, r):
    """Finding 4: HTTP read the body with no timeout: a caller trickling a body held its
    call for as long as it liked, and as many calls as it opened."""
    c = free_key(r)

    def head(key: str | None) -> bytes:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        return (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f'{auth}Content-Length: 4000000\r\n\r\n{{"prompt": "'
        ).encode()

    keyless = _send(guarded.http_port, head(None))
    assert _status(keyless) == 401  # no key: answered before any of the body
    started = time.monotonic()
    trickles = [_send(guarded.http_port, head(c)) for _ in range(2)]
    wait_until(
        lambda: scrape(guarded.metrics_port)["specserve_gateway_calls_awaiting_request"] == 2,
        "both trickled bodies counted",
        timeout=10,
    )
    third = _send(guarded.http_port, head(c))
    assert _status(third) == 429  # past the key's share (2 streams) at once
    assert [_status(s) for s in trickles] == [408, 408]  # and those end within the timeout
    assert time.monotonic() - started < 8
    for s in (keyless, third, *trickles):
        s.close()


def test_a_refused_request_costs_its_key_a_request(cluster, r):
    """Finding 5: tokenizing and validating ran before the request was charged, so a
    refused request cost its key nothing: a key could have a 4 MiB prompt tokenized as
    often as it liked."""
    c = free_key(r)
    channel = grpc.insecure_channel(cluster.procs["gateway"].address)
    gw = generation_pb2_grpc.GenerationServiceStub(channel)
    too_long = "word " * 3000  # past the cluster's max_seq_len (2048) once tokenized
    for _ in range(DEFAULT_TIERS["free"].requests_per_minute):
        err = refused(lambda: call(gw, c, prompt=too_long, max_tokens=2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    err = refused(lambda: call(gw, c, prompt="x", max_tokens=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests per minute" in (
        err.details()
    )
    channel.close()


class HeldProxy:
    """A TCP proxy to a port that holds back a command sent through it: the first chunk
    towards the port holding one of the `trap`'s words waits (and its connection with it),
    until `release`."""

    def __init__(self, port: int):
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.trap: tuple[bytes, ...] = ()
        self.caught = threading.Event()
        self.released = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, towards: bool) -> None:
        try:
            while data := src.recv(65536):
                if towards and not self.caught.is_set() and any(w in data for w in self.trap):
                    self.caught.set()
                    self.released.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.released.set()
        self.listener.close()


def test_a_call_that_ends_while_its_submit_is_on_the_way_leaves_nothing_running(cluster, keys, r):
    """Finding 6: a call cancelled while Submit was in flight could leave a request that ran
    to max_tokens for nobody (its slot and tokens refunded). Here the scheduler's Redis is held
    back while it creates the request: the client leaves, then Redis answers."""
    proxy = HeldProxy(int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0]))
    redis_url = cluster.redis_url.replace(f":{proxy.upstream}/", f":{proxy.port}/")
    cluster.start_service(
        "scheduler",
        {"SPECSERVE_SCHEDULER_SCHEDULER_ID": "held", "SPECSERVE_SCHEDULER_REDIS_URL": redis_url},
        instance="scheduler-held",
    )
    env = {"SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler-held"].address}
    cluster.start_service("gateway", env, instance="gateway-held")
    channel = grpc.insecure_channel(cluster.wait_ready("gateway-held", 120).address)
    try:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        a = keys["a"]
        # Its Submit's first command (how full Redis is), or the create, is held back.
        proxy.trap = (b"memory", b"a:race-1")
        request = generation_pb2.GenerateRequest(
            request_id="race-1", prompt="def f():", max_tokens=64, sampling=GREEDY
        )
        stream = stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {a}")])
        assert proxy.caught.wait(30), "the scheduler's Submit never reached Redis"
        stream.cancel()  # the client leaves while Submit is on its way
        slots = quota_keys(split_key(a))[1]
        wait_until(lambda: r.zcard(slots) == 0, "the gateway ending the call", 30)
        proxy.released.set()
        store = RequestStore(r)
        record = wait_until(
            lambda: (
                (rec := store.get("a:race-1")) and rec.status in ("finished", "cancelled") and rec
            ),
            "the request ended",
            60,
        )
        assert record.status == "cancelled" and record.generated < 64, record
    finally:
        proxy.close()
        channel.close()
        for key in ("gateway-held", "scheduler-held"):
            cluster.kill(key)


def test_a_filling_redis_keeps_less_and_refuses_new_work_before_it_is_full(gw, keys, r):
    """Finding 7: ended requests stayed an hour whatever Redis held, and a Redis at its
    maxmemory (noeviction) failed every write: creates, steps, ends and heartbeats."""
    a = keys["a"]
    limit = int(r.info("memory")["used_memory"]) + 64 * 2**20
    r.config_set("maxmemory", limit)
    filler = []

    def fill_to(fraction: float) -> None:
        while r.info("memory")["used_memory"] < fraction * limit:
            filler.append(f"filler:{len(filler)}")
            r.set(filler[-1], b"x" * 2**20)

    try:
        fill_to(0.6)  # past half: what ends now is kept a minute, not an hour
        call(gw, a, prompt="def f():", max_tokens=2, request_id="pressed-1")
        ttl = wait_until(
            lambda: r.ttl("specserve:req:a:pressed-1") > 0 and r.ttl("specserve:req:a:pressed-1"),
            "the ended request's expiry",
            30,
        )
        assert ttl <= 60

        def refusal() -> grpc.RpcError | None:  # (it reads Redis's memory every 0.5 s)
            try:
                assert call(gw, a, prompt="def g():", max_tokens=2)[-1].final.finish_reason
                return None
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                return e

        fill_to(0.9)  # past the scheduler's admit fraction (0.85): new work is refused
        err = wait_until(refusal, "new work refused", 30)
        assert "maxmemory" in err.details() and "retry" in err.details()
        assert r.ping() and r.set("a-write", 1)  # (Redis still takes the cluster's writes)
        r.delete(*filler, "a-write")
        filler.clear()
        wait_until(lambda: not refusal(), "new work served again", 30)
    finally:
        r.config_set("maxmemory", 0)
        if filler:
            r.delete(*filler)


def test_each_service_reaches_only_its_own_redis_keys(cluster, gw, keys, r):
    """Finding 9: one Redis password for every workload and no ACL users: a drafter pod could
    mint an API key with one HSET, and any service read every prompt and run CONFIG."""
    call(gw, keys["a"], prompt="def f():", max_tokens=2, request_id="acl-1")
    users = {c["user"] for c in r.client_list()}
    assert {"gateway", "scheduler", "verifier"} <= users  # each serves as its own user
    as_user = {
        s: redis.Redis.from_url(cluster.config[s]["redis_url"], decode_responses=True)
        for s in SERVICES
    }
    key_id = split_key(keys["a"])
    denied = redis.exceptions.NoPermissionError
    attempts = {
        "drafter": [
            lambda c: c.hset(key_record("minted"), mapping={"tenant": "a", "digest": "x"}),
            lambda c: c.hgetall("specserve:req:a:acl-1"),  # another's prompt
            lambda c: c.xrange("specserve:out:a:acl-1"),  # and output
        ],
        "scheduler": [lambda c: c.hgetall(key_record(key_id)), lambda c: c.sadd(KEY_IDS, "x")],
        "verifier": [lambda c: c.hset(quota_keys(key_id)[0], "tok", 10**9)],
        "gateway": [lambda c: c.config_set("maxmemory", 1), lambda c: c.flushall()],
    }
    for service, tries in attempts.items():
        for attempt in tries:
            with pytest.raises(denied):
                attempt(as_user[service])
    for service in SERVICES:  # no service runs the operator's commands
        with pytest.raises(denied):
            as_user[service].config_get("maxmemory")
    assert as_user["gateway"].hgetall(key_record(key_id))["tenant"] == "a"  # its own keys
    assert not r.exists(key_record("minted"))


def test_one_tenant_holds_at_most_its_cap_of_redis(cluster, r):
    """Finding 7: a batch-tier key (1M tokens a minute, unused tokens refunded) wrote about
    400 MB of prompts an hour into a Redis of 1 GB, for every tenant to run out of it."""
    env = {
        "SPECSERVE_SCHEDULER_SCHEDULER_ID": "capped",
        "SPECSERVE_SCHEDULER_TENANT_STORED_BYTES_LIMIT": "20000",
    }
    cluster.start_service("scheduler", env, instance="scheduler-capped")
    env = {"SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler-capped"].address}
    cluster.start_service("gateway", env, instance="gateway-capped")
    channel = grpc.insecure_channel(cluster.wait_ready("gateway-capped", 120).address)
    try:
        gw = generation_pb2_grpc.GenerationServiceStub(channel)
        store = KeyStore(r)
        hog, other = (store.create(t, "batch", DEFAULT_TIERS["batch"]) for t in ("hog", "other"))
        prompt = "word " * 400  # (its spec alone: a few kB)
        served = 0
        while served < 50:
            try:
                call(gw, hog, prompt=prompt, max_tokens=2)
                served += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                assert "tenant hog" in e.details() and "20000" in e.details()
                break
        assert 2 <= served < 50  # some served, then refused at its cap
        assert call(gw, other, prompt=prompt, max_tokens=2)[-1].final.finish_reason
    finally:
        channel.close()
        for key in ("gateway-capped", "scheduler-capped"):
            cluster.kill(key)
