"""Hostile input over real HTTP, as test_fuzz does over gRPC: hypothesis throws random bodies,
bytes, content types and paths at the OpenAI-compatible API. Every one gets a 4xx in OpenAI's
error shape (or a normal answer), never a 5xx, a traceback or a hang; a normal request works
right after. Each call has a timeout well past what an answer takes here: a call that runs
into it hung, and fails the test."""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.cluster  # every test here runs a cluster

TIMEOUT_S = 20
CASES = 150
CLEAN = {400, 403, 404, 405, 413, 415, 429}  # anything else but 200 is a bug
seen: Counter[int] = Counter()  # statuses of the random bodies
FIELDS = (
    "model",
    "input",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "priority",
    "session_id",
    "presence_penalty",
    "logit_bias",
    "unknown",
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, -1, 0, 1e300, "", "x" * 3000, [], {}, [[]], [""]])
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def port(tiny_cluster) -> int:
    return tiny_cluster.procs["gateway"].http_port


@pytest.fixture(scope="module")
def model(port) -> str:
    status, _, body = call(port, "GET", "/v1/models", b"")
    assert status == 200
    return json.loads(body)["data"][0]["id"]


def call(port: int, method: str, path: str, body: bytes, content_type="application/json"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    except TimeoutError:
        pytest.fail(f"hung: no answer within {TIMEOUT_S} s")
    finally:
        conn.close()


def check(status: int, content_type: str, raw: bytes) -> None:
    if status == 200:
        if content_type.startswith("text/event-stream"):
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        else:
            assert json.loads(raw)["choices"], raw[:200]
        return
    assert status in CLEAN, (status, raw[:300])
    error = json.loads(raw)["error"]
    assert error["message"] and "Traceback" not in error["message"], error
    assert {"type", "param", "code"} <= set(error), error


@st.composite
def bodies(draw, model: str) -> tuple[str, object]:
    """(path, body): a sane request with up to three fields set to any JSON at all."""
    chat = draw(st.booleans())
    bad = draw(st.sets(st.sampled_from(FIELDS), max_size=3))
    body: dict = {"model": model, "max_tokens": draw(st.integers(1, 3)), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
    else:
        body["prompt"] = draw(
            st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 500), min_size=1, max_size=8)
        )
    for name in bad:
        key = {"input": "messages" if chat else "prompt", "unknown": draw(st.text(max_size=8))}
        body[key.get(name, name)] = draw(json_values)
    if draw(st.booleans()):
        body = draw(json_values) if draw(st.integers(0, 9)) == 0 else body  # not an object at all
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_bodies_get_clean_answers(port, model, data):
    path, body = data.draw(bodies(model))
    status, content_type, raw = call(port, "POST", path, json.dumps(body).encode())
    seen[status] += 1
    check(status, content_type, raw)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    raw=st.binary(max_size=300),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "", "application/json; charset=utf-8"]
    ),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/x", "/"]),
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE"]),
)
def test_random_bytes_paths_and_methods_get_clean_answers(port, raw, content_type, path, method):
    status, ctype, answer = call(port, method, path, raw, content_type)
    if status == 200 and path == "/v1/models":
        assert json.loads(answer)["object"] == "list"
        return
    check(status, ctype, answer)


def test_a_normal_request_works_after_the_fuzzing(port, model):
    print(f"\nhttp fuzz: random bodies by status {dict(sorted(seen.items()))}")
    assert seen[200] and seen[400]  # (both kinds of body were drawn)
    body = {"model": model, "prompt": "Once", "max_tokens": 3, "temperature": 0}
    status, _, raw = call(port, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] >= 1
