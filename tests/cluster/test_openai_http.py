"""The OpenAI-compatible HTTP API with real clients: the official `openai` package (streamed and
not, chat and completions) and curl, through TLS with API keys; OpenAI's error shapes and
statuses; a client that disconnects; and the same greedy output as over gRPC."""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys

import grpc
import openai
import pytest
import redis
from openai import DefaultHttpx2Client, OpenAI

from conftest import tls_cluster_config
from helpers import request, wait_until
from specserve.common.settings import DEFAULT_TIERS
from specserve.common.tls import make_dev_certs
from specserve.gateway.keys import KeyStore
from specserve.store import AUDIT_STREAM, quota_keys, req_key
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2_grpc

pytestmark = pytest.mark.cluster  # every test here runs a cluster

# The Chat Completions example of the openai package's README, as it stands there: run with only
# OPENAI_BASE_URL and OPENAI_API_KEY set (and the dev CA trusted, as SSL_CERT_FILE).
README_MODEL = "gpt-5.5"
README_SCRIPT = """
from openai import OpenAI

client = OpenAI()

completion = client.chat.completions.create(
    model="gpt-5.5",
    messages=[
        {"role": "developer", "content": "Talk like a pirate."},
        {
            "role": "user",
            "content": "How do I check if a Python object is an instance of a class?",
        },
    ],
)

print(completion.choices[0].message.content)
"""
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_model_dir, certs):
    """A cluster with TLS and API keys, the HTTP API on, answering to README_MODEL too."""
    gateway = {
        "auth": "api_key",
        "http_model_aliases": [README_MODEL],
        "http_max_body_bytes": MAX_BODY,
    }
    config = tls_cluster_config(tiny_model_dir, certs, gateway=gateway)
    cluster = LocalCluster(config, tmp_path_factory.mktemp("http"))
    cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def keys(api):
    return KeyStore(redis.Redis.from_url(api.redis_url, decode_responses=True))


@pytest.fixture(scope="module")
def key(keys):
    return keys.create("acme", "standard", DEFAULT_TIERS["standard"])


def base_url(api) -> str:
    return f"https://127.0.0.1:{api.procs['gateway'].http_port}/v1"


def client(api, certs, key: str) -> OpenAI:
    tls = ssl.create_default_context(cafile=str(certs["ca"]))
    return OpenAI(
        base_url=base_url(api),
        api_key=key,
        http_client=DefaultHttpx2Client(verify=tls),
        max_retries=0,
    )


def served_model(api, certs, key) -> str:
    return client(api, certs, key).models.list().data[0].id


def post(api, certs, path: str, body, key: str | None = None, headers=None, method="POST"):
    """One raw HTTPS call: (status, headers, parsed JSON body)."""
    tls = ssl.create_default_context(cafile=str(certs["ca"]))
    port = api.procs["gateway"].http_port
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=60)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key:
        sent["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=raw if method == "POST" else None, headers=sent)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), json.loads(data)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon"}]


def test_the_openai_client_chats_and_completes_streamed_and_not(api, certs, key):
    oa = client(api, certs, key)
    model = served_model(api, certs, key)
    whole = oa.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop") and choice.message.content
    assert whole.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    speculation = whole.model_extra["speculation"]  # the extension field
    assert speculation["steps"] >= 1 and "accepted_tokens" in speculation

    stream = oa.chat.completions.create(
        model=model,
        messages=CHAT,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    usage = chunks[-1].usage  # (its prompt_tokens_details may differ: the prefix cache)
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens

    prompt = "def fib(n):"
    done = oa.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=10)
    assert done.object == "text_completion" and done.choices[0].text
    streamed = oa.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=10, stream=True
    )
    parts = [c.choices[0].text for c in streamed]
    assert "".join(parts) == done.choices[0].text and len(parts) > 1


def test_the_sdk_readme_script_runs_unchanged(api, certs, key):
    assert f'model="{README_MODEL}"' in README_SCRIPT
    env = {
        **os.environ,
        "OPENAI_BASE_URL": base_url(api),
        "OPENAI_API_KEY": key,
        "SSL_CERT_FILE": str(certs["ca"]),
    }
    run = subprocess.run(
        [sys.executable, "-c", README_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def test_curl_reads_server_sent_events(api, certs, key):
    body = {"model": README_MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8}
    _, _, whole = post(api, certs, "/v1/chat/completions", body, key)
    run = subprocess.run(
        [
            "curl", "-sS", "-N", "--fail-with-body", "--cacert", str(certs["ca"]),
            f"{base_url(api)}/chat/completions",
            "-H", f"Authorization: Bearer {key}",
            "-H", "Content-Type: application/json",
            "-d", json.dumps(body | {"stream": True}),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr + run.stdout
    events = [line.removeprefix("data: ") for line in run.stdout.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in run.stdout.split("\n\n") if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def open_stream(api, certs, key: str, max_tokens: int = 1000):
    """A streamed completion, read up to its first event: (connection, response, stored id)."""
    tls = ssl.create_default_context(cafile=str(certs["ca"]))
    port = api.procs["gateway"].http_port
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=60)
    body = {"model": README_MODEL, "prompt": "Once", "max_tokens": max_tokens, "stream": True}
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    response = conn.getresponse()
    assert response.status == 200
    first = json.loads(response.readline().decode().removeprefix("data: "))
    return conn, response, "acme:" + first["id"].removeprefix("cmpl-")  # (the tenant's id)


def test_a_client_that_disconnects_mid_stream_cancels_its_request(api, certs, keys, key):
    conn, response, rid = open_stream(api, certs, key)
    r = redis.Redis.from_url(api.redis_url, decode_responses=True)
    streams = quota_keys(key.split("_")[1])[1]
    assert r.zcard(streams) == 1 and r.hget(req_key(rid), "status") != "cancelled"
    response.close()
    conn.close()  # the client is gone mid-stream
    wait_until(lambda: r.hget(req_key(rid), "status") == "cancelled", "request cancelled")
    wait_until(lambda: r.zcard(streams) == 0, "stream slot given back")
    assert int(r.hget(req_key(rid), "generated")) < 1000


def test_greedy_output_over_http_is_the_grpc_output(api, certs, key):
    credentials = grpc.ssl_channel_credentials(certs["ca"].read_bytes())
    auth = [("authorization", f"Bearer {key}")]
    with grpc.secure_channel(api.procs["gateway"].address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        over_grpc = list(stub.Generate(request(prompt="The cat", max_tokens=24), metadata=auth))
        chat = request(max_tokens=16)
        for m in CHAT:
            chat.messages.messages.add(role=m["role"], content=m["content"])
        chat_grpc = list(stub.Generate(chat, metadata=auth))
    oa = client(api, certs, key)
    model = served_model(api, certs, key)
    done = oa.completions.create(model=model, prompt="The cat", temperature=0, max_tokens=24)
    assert done.choices[0].text == "".join(c.text for c in over_grpc)
    assert done.usage.completion_tokens == sum(len(c.token_ids) for c in over_grpc)
    said = oa.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=16)
    assert said.choices[0].message.content == "".join(c.text for c in chat_grpc)
    length = chat_grpc[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert said.choices[0].finish_reason == ("length" if length else "stop")


def error_of(status: int, body: dict) -> dict:
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]


def test_errors_come_in_openai_shape_with_its_statuses(api, certs, keys, key):
    ok = {"model": README_MODEL, "prompt": "x", "max_tokens": 2}
    cases = [  # (body, key, headers, status, param or None)
        (ok, None, {}, 401, None),
        (ok, "ssk_000000000000_" + "y" * 48, {}, 401, None),
        (ok | {"model": "nope"}, key, {}, 404, "model"),
        (ok | {"max_tokens": "5"}, key, {}, 400, "max_tokens"),
        (ok | {"temperature": 7}, key, {}, 400, "temperature"),
        (ok | {"n": 2}, key, {}, 400, "n"),
        (ok | {"logprobs": 21}, key, {}, 400, "logprobs"),
        (ok | {"stop": ["x"] * 40}, key, {}, 400, "stop"),
        (ok | {"max_tokens": 5000}, key, {}, 400, "max_tokens"),
        (b'{"model": ', key, {}, 400, None),
        (b"[1, 2]", key, {}, 400, None),
        (ok, key, {"Content-Type": "text/plain"}, 415, None),
        (b"{" + b" " * MAX_BODY + b"}", key, {}, 413, None),
    ]
    r = redis.Redis.from_url(api.redis_url, decode_responses=True)
    audited_before = r.xlen(AUDIT_STREAM)
    for body, k, headers, status, param in cases:
        got, _, answer = post(api, certs, "/v1/completions", body, k, headers)
        assert got == status, (body if isinstance(body, dict) else body[:40], answer)
        assert error_of(got, answer)["param"] == param, answer

    # Every refusal is audited, as on the gRPC port (a wrong key's guesses too). (An earlier
    # test's completions may be audited meanwhile: their records are settled off the loop.)
    def refusals():
        rows = [f for _, f in r.xrange(AUDIT_STREAM)][audited_before:]
        return [f for f in rows if not f["status"].startswith("FINISH_REASON_")]

    wait_until(lambda: len(refusals()) >= len(cases), "refusals audited")
    rows = refusals()
    assert {f["protocol"] for f in rows} == {"http"}
    expected = ["UNAUTHENTICATED"] * 2 + ["NOT_FOUND"] + ["INVALID_ARGUMENT"] * 10
    assert sorted(f["status"] for f in rows) == sorted(expected)
    assert sorted(f["tenant"] for f in rows) == [""] * 2 + ["acme"] * 11  # (once known)
    for path, method, status in [("/v1/nothing", "GET", 404), ("/v1/models", "DELETE", 405)]:
        got, _, answer = post(api, certs, path, b"", key, method=method)
        assert got == status and error_of(got, answer)
    for path in ("/health", "/readyz", "/livez"):
        assert post(api, certs, path, b"", method="GET")[0] == 200

    free = keys.create("thrifty", "free", DEFAULT_TIERS["free"])
    got, _, answer = post(api, certs, "/v1/completions", ok | {"priority": "batch"}, free)
    assert got == 403 and "batch" in error_of(got, answer)["message"]
    got, _, answer = post(api, certs, "/v1/completions", ok | {"max_tokens": 600}, free)
    assert got == 403 and error_of(got, answer)


def test_a_key_over_its_stream_cap_gets_429_with_retry_after(api, certs, keys):
    free = keys.create("capped", "free", DEFAULT_TIERS["free"])  # 2 concurrent streams
    oa = client(api, certs, free)
    held = [
        oa.completions.create(model=README_MODEL, prompt="Once", max_tokens=500, stream=True)
        for _ in range(DEFAULT_TIERS["free"].concurrent_streams)
    ]
    for stream in held:
        next(iter(stream))  # open and producing
    body = {"model": README_MODEL, "prompt": "x", "max_tokens": 2}
    got, headers, answer = post(api, certs, "/v1/completions", body, free)
    assert got == 429 and error_of(got, answer)["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 0
    with pytest.raises(openai.RateLimitError):
        oa.completions.create(model=README_MODEL, prompt="x", max_tokens=2)
    for stream in held:
        stream.close()
    with pytest.raises(openai.AuthenticationError):
        client(api, certs, "ssk_000000000000_" + "z" * 48).models.list()


def test_a_drain_cuts_http_streams_and_cancels_their_requests(api, certs, key):
    """(Last here: it stops the gateway.) A gRPC stream cut by a drain is re-attached to; an
    HTTP client cannot re-attach, so its request is cancelled rather than run for nobody."""
    conn, response, rid = open_stream(api, certs, key, max_tokens=1000)
    api.kill("gateway", signal.SIGTERM)  # drains for drain_seconds (1 s), then cuts
    try:
        response.read()
    except http.client.IncompleteRead:
        pass  # (cut mid-stream)
    conn.close()
    r = redis.Redis.from_url(api.redis_url, decode_responses=True)
    wait_until(lambda: r.hget(req_key(rid), "status") == "cancelled", "cut request cancelled")
    assert int(r.hget(req_key(rid), "generated")) < 1000
