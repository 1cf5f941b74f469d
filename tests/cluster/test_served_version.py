"""The served model version names everything that changes a greedy output (weights, dtype,
device), and the result cache keys on it: a result replays only where the version that
produced it would serve the request again."""

from __future__ import annotations

import contextlib
import signal

import pytest
import redis

from conftest import DEVICE_KIND, F32_KIND
from helpers import generate, request, wait_until
from specserve.common.pools import CANARY, STABLE
from specserve.common.settings import ModelRef, VerifierSettings
from specserve.engine import kernels, models
from specserve.gateway.result_cache import result_cache_key, serving_versions
from specserve.store import RequestStore, result_key
from specserve.v1 import generation_pb2, scheduler_pb2
from specserve.verifier.server import Served

DTYPES = ("float32", "bfloat16")


def served(model_dir, **settings) -> Served:
    ref = ModelRef(path=str(model_dir))
    path, manifest = models.resolve(ref, model_dir)
    return Served.of(VerifierSettings(model=ref, **settings), models.fingerprint(path, manifest))


def test_two_dtypes_are_two_versions_with_two_cache_keys(tiny_model_dir):
    by_dtype = {dtype: served(tiny_model_dir, dtype=dtype) for dtype in DTYPES}
    versions = {dtype: s.version for dtype, s in by_dtype.items()}
    assert versions["float32"] != versions["bfloat16"]
    # (the engine's paged attention kernel names the revision of its rounding; bfloat16 on
    # a CPU runs torch's attention)
    assert versions["float32"].endswith(f":float32:{F32_KIND}")
    assert versions["bfloat16"].endswith(":bfloat16:cpu")
    assert len({s.sha256 for s in by_dtype.values()}) == 1  # the same weights
    greedy = scheduler_pb2.SubmitRequest(prompt_ids=[1, 2, 3], max_tokens=5)
    assert len({result_cache_key(greedy, v) for v in versions.values()}) == 2
    # The kind of device is part of it too; what only places requests is not.
    ref = ModelRef(path=str(tiny_model_dir))
    on_gpu = models.served_version(
        ref, by_dtype["float32"].sha256, dtype="float32", device="cuda:1"
    )
    assert on_gpu == versions["float32"].removesuffix(f":{F32_KIND}") + ":cuda"
    assert served(tiny_model_dir, port=1, batch_size=2).version == versions["float32"]
    # torch's padded attention on a CPU rounds differently from the engine's paged kernel
    padded = Served.of(VerifierSettings(model=ref), by_dtype["float32"].sha256, "padded")
    assert padded.version == versions["float32"].removesuffix(f":{F32_KIND}") + ":cpu-padded"


def test_int4_on_torchs_kernel_is_a_version_of_its_own(tiny_model_dir, monkeypatch):
    """The engine's int4 kernel and torch's round differently: two versions."""
    if not kernels.cpu_supported():
        pytest.skip("the engine's int4 kernel is for x86 CPUs with AVX2")
    ref = ModelRef(path=str(tiny_model_dir))
    ours = models.served_version(ref, "0" * 64, dtype="int4", device="cpu")
    monkeypatch.setenv("SPECSERVE_INT4_KERNEL", "torch")
    torchs = models.served_version(ref, "0" * 64, dtype="int4", device="cpu")
    assert ours.endswith(f":int4:{F32_KIND}") and torchs == ours.replace(":int4:", ":int4-torch:")
    assert models.served_version(ref, "0" * 64, dtype="int4", device="cuda") == ours.replace(
        f":int4:{F32_KIND}", ":int4:cuda"
    )


def test_the_versions_looked_up_are_those_of_the_pool_a_request_goes_to():
    rows = [
        {"id": "a", "pool": STABLE, "version": "m:1:float32:cpu"},
        {"id": "b", "pool": CANARY, "version": "m:1:bfloat16:cpu"},
    ]
    assert serving_versions(rows, 0.0, "any") == ["m:1:float32:cpu"]
    assert serving_versions(rows, 1.0, "any") == ["m:1:bfloat16:cpu"]
    assert serving_versions(rows[1:], 0.5, "any") == ["m:1:bfloat16:cpu"]  # stable is down
    assert serving_versions([], 0.0, "any") == []


@pytest.mark.cluster
def test_a_result_replays_only_on_the_dtype_that_produced_it(tiny_cluster, gateway, tokenizer):
    """A bfloat16 verifier joins as the canary: the float32 result does not answer requests
    sent there, and the bfloat16 one does not answer requests sent to float32."""
    ids = tokenizer("def mean(xs):").input_ids
    greedy = request(prompt_ids=ids, max_tokens=8, use_result_cache=True)
    r = redis.Redis.from_url(tiny_cluster.redis_url, decode_responses=True)
    store = RequestStore.from_url(tiny_cluster.redis_url)
    first = generate(gateway, greedy)
    f32 = first.final.model_version
    assert f32.endswith(f":float32:{F32_KIND}") and not first.final.cached
    assert generate(gateway, greedy).final.cached
    submit = scheduler_pb2.SubmitRequest(prompt_ids=ids, max_tokens=8)
    assert r.exists(result_key(result_cache_key(submit, f32)))

    with canary_verifier(tiny_cluster, store, "bfloat16"):
        store.set_canary_share(1.0)
        bf16 = wait_for_canary_version(gateway)
        assert bf16.endswith(f":bfloat16:{DEVICE_KIND}")
        assert bf16.rsplit(":", 2)[0] == f32.rsplit(":", 2)[0]
        on_bf16 = generate(gateway, greedy)
        assert not on_bf16.final.cached and on_bf16.final.model_version == bf16
        assert generate(gateway, greedy).final.cached  # now cached for bfloat16 too
        assert r.exists(result_key(result_cache_key(submit, bf16)))
        store.set_canary_share(0.0)
        back = generate(gateway, greedy)
        assert back.final.cached and back.final.model_version == f32
        assert back.ids == first.ids


@pytest.mark.cluster
def test_a_verifier_with_dtype_auto_serves_and_names_the_dtype_it_chose(tiny_cluster, gateway):
    """`dtype: auto` is resolved at start: the log says what it chose and why, and the served
    version (registry, GetModelInfo, every final) names that dtype, never "auto"."""
    store = RequestStore.from_url(tiny_cluster.redis_url)
    with canary_verifier(tiny_cluster, store, "auto"):
        version = wait_for_canary_version(gateway)
        chosen = version.rsplit(":", 2)[1]
        assert chosen in ("int4", "int8", "bfloat16", "float16", "float32")
        log = tiny_cluster.log_path("verifier-auto").read_text()
        assert f"verifier.dtype: auto chose {chosen}" in log
        assert "fastest decode row" in log or DEVICE_KIND == "cuda"
        store.set_canary_share(1.0)
        reply = generate(gateway, request(prompt_ids=[1, 2, 3], max_tokens=4))
        assert reply.final.model_version == version


@contextlib.contextmanager
def canary_verifier(cluster, store: RequestStore, dtype: str):
    """A second verifier, in `dtype`, in the canary pool (instance `verifier-<dtype>`); on
    leaving, the canary's share back to 0 and the verifier drained (it leaves the registry)."""
    name = f"verifier-{dtype}"
    cluster.start_service(
        "verifier",
        {"SPECSERVE_VERIFIER_DTYPE": dtype, "SPECSERVE_VERIFIER_POOL": CANARY},
        instance=name,
    )
    try:
        cluster.wait_ready(name, 120)
        yield
    finally:
        store.set_canary_share(0.0)
        cluster.kill(name, signal.SIGTERM)


def wait_for_canary_version(gateway, timeout: float = 30) -> str:
    """The canary pool's version once the gateway's registry read lists it."""

    def canary_versions() -> list[str]:
        info = gateway.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        return {p.pool: list(p.model_versions) for p in info.pools}.get(CANARY, [])

    return wait_until(canary_versions, "a canary verifier registered", timeout)[0]
