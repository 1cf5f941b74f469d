"""Fixtures: tiny random models, and real clusters (redis-server + four service processes).

The folders mirror the code: tests/unit/<package>/ (a package's own parts, in-process),
tests/cluster/ (the services as real processes), tests/chaos/ (killing and cutting them),
tests/deploy/ (manifests, alerts, images, benchmarks' wiring). Each test is marked with its
folder (`unit`, `cluster_tests`, `chaos`, `deploy`).

Tiers (README, "Tests"): a test that starts a service process is marked `cluster`, one that
loads the default 1.5B target `default_model`, and one whose length is what it tests `long`.
`make test-fast` runs the unit tests that are none of these; `make test` (CI) runs all but
`long`; `make test-long` the long ones. A test that starts a service without its `cluster`
mark fails, so that the fast tier stays fast."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from specserve.common.settings import ModelRef, ServiceSettings  # noqa: E402
from specserve.common.tls import dev_tls_config  # noqa: E402
from specserve.engine import (
    kernels,  # noqa: E402
    models,
)
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import generation_pb2_grpc  # noqa: E402

TARGET = ModelRef()  # the default target model
# Where models run in the tests: `SPECSERVE_TEST_DEVICE=cuda make test` on a machine with a GPU.
DEVICE = os.environ.get("SPECSERVE_TEST_DEVICE", "cpu")
DEVICE_KIND = DEVICE.partition(":")[0]  # as model versions name it: cuda:1 is cuda
# Tests of the engine's own CPU kernels run where the CPU is the test device and has AVX2 (a
# kernel that then fails to build fails them rather than skipping them).
CPU_KERNELS_RUN = DEVICE == "cpu" and kernels.cpu_supported()
CPU_KERNELS_WHY_NOT = "the engine's CPU kernels: x86 with AVX2, the CPU as the test device"
CPU_KERNELS = pytest.mark.skipif(not CPU_KERNELS_RUN, reason=CPU_KERNELS_WHY_NOT)
# The kind a model version names for float32 activations (float32, int8, int4 weights): on a
# CPU with the engine's kernels, their paged attention and the revision of its rounding.
F32_KIND = f"cpu-paged{kernels.PAGED_ATTENTION_ROUNDING}" if CPU_KERNELS_RUN else DEVICE_KIND
NOISE = 2.0


FOLDERS = {"unit": "unit", "cluster": "cluster_tests", "chaos": "chaos", "deploy": "deploy"}


def pytest_collection_modifyitems(items):
    """Marks each test with its folder, so that `-m unit` (say) selects a folder's tests."""
    for item in items:
        folder = item.path.relative_to(Path(__file__).parent).parts[0]
        if folder in FOLDERS:
            item.add_marker(FOLDERS[folder])


_running: pytest.Item | None = None  # the test being set up, run or torn down


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


_start_service = LocalCluster.start_service


def _marked_start_service(self, name, *args, **kwargs):
    """LocalCluster.start_service, refused to a test without the `cluster` mark."""
    if _running is not None and _running.get_closest_marker("cluster") is None:
        pytest.fail(f"{_running.nodeid} starts a {name}: mark it cluster (conftest.py)")
    return _start_service(self, name, *args, **kwargs)


LocalCluster.start_service = _marked_start_service


def default_target_dir() -> Path:
    cache = ServiceSettings.load(None).model_cache_dir
    try:
        path, _ = models.resolve(TARGET, cache)
    except models.ModelError as e:
        pytest.fail(f"{e} (make test fetches it)")
    return path


@pytest.fixture(scope="session")
def tokenizer():
    return models.load_tokenizer(default_target_dir())


def save_tiny_qwen(
    path: Path, tokenizer, noise: float = 0.0, hidden_size: int = 64, intermediate_size: int = 128
) -> Path:
    """A 2-layer random Qwen2 with the default target's tokenizer, saved in float32; with
    noise, every weight of that same model is perturbed by noise * its tensor's std."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """The tiny target."""
    return save_tiny_qwen(tmp_path_factory.mktemp("tiny-model"), tokenizer)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny draft that agrees with the tiny target only part of the time."""
    return save_tiny_qwen(tmp_path_factory.mktemp("tiny-draft"), tokenizer, noise=NOISE)


@pytest.fixture(scope="session")
def tiny_draft(tiny_draft_dir):
    return models.load_model(tiny_draft_dir, DEVICE, "float32")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    return models.load_model(tiny_model_dir, DEVICE, "float32")


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server with AOF (a LocalCluster without services), to kill and restart."""
    cluster = LocalCluster({}, tmp_path, redis_aof=True)
    cluster.start_redis()
    yield cluster
    cluster.kill_redis()


@pytest.fixture
def redis_store(redis_server) -> RequestStore:
    """A RequestStore on `redis_server`, with its queues made."""
    store = RequestStore.from_url(redis_server.redis_url)
    store.ensure_queues()
    return store


def cluster_config(model_dir: Path | None, **sections) -> dict:
    model = {"path": str(model_dir)} if model_dir else {}
    config = {
        "common": {"log_level": "INFO", "heartbeat_seconds": 0.5, "drain_seconds": 1},
        "gateway": {"model": model, "max_seq_len": 2048, "max_tokens_limit": 1024, "http_port": 0},
        "scheduler": {},
        "verifier": {
            "model": model,
            "device": DEVICE,
            "batch_size": 4,
            "max_seq_len": 2048,
            "torch_threads": 1,
            "compile": False,  # compiling costs a minute a start; test_compile.py compiles
        },
        # Random tiny models are never confident: let their trees grow anyway.
        "drafter": {"device": DEVICE, "compile": False}
        | ({"draft_model_path": str(model_dir), "min_path_prob": 0} if model_dir else {}),
    }
    # Plaintext and one anonymous tenant: TLS and API keys are tested in test_security.py.
    config = without_security(config)
    for name, values in sections.items():
        config[name].update(values)
    return config


def tls_cluster_config(model_dir: Path | None, certs: dict[str, Path], **sections) -> dict:
    """`cluster_config` with TLS on every port, from a `make_dev_certs` set."""
    common = {"insecure": False, **sections.pop("common", {})}
    config = cluster_config(model_dir, common=common, **sections)
    for section, values in dev_tls_config(certs).items():
        config[section].update(values)
    return config


@pytest.fixture(scope="session")
def tiny_cluster(tmp_path_factory, tiny_model_dir):
    cluster = LocalCluster(cluster_config(tiny_model_dir), tmp_path_factory.mktemp("cluster"))
    cluster.start(timeout=180)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def drafting_cluster(tmp_path_factory, tiny_model_dir, tiny_draft_dir):
    """The tiny target with a draft model that agrees with it part of the time, trees of 8
    every step: drafts are accepted and rejected, so emitted tokens come from every kind of
    row (structured outputs, log-probabilities)."""
    config = cluster_config(tiny_model_dir)
    config["verifier"].update(
        speculative_decoding=True, verification_tree_size=8, speculation_policy="fixed"
    )
    config["drafter"].update(draft_model_path=str(tiny_draft_dir), branching=2, width=4)
    cluster = LocalCluster(config, tmp_path_factory.mktemp("drafting"))
    cluster.start(timeout=180)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def drafting_stub(drafting_cluster):
    channel = grpc.insecure_channel(drafting_cluster.procs["gateway"].address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()


@pytest.fixture(scope="session")
def drafting_api(drafting_cluster):
    """The openai client on drafting_cluster's HTTP API."""
    from openai import OpenAI

    port = drafting_cluster.procs["gateway"].http_port
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="session")
def gateway(tiny_cluster):
    channel = grpc.insecure_channel(tiny_cluster.procs["gateway"].address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()
