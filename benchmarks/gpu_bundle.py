"""What `make gpu-check` needs on a GPU machine that has no network and no copy of this
machine's venv, packed into one file: `make gpu-bundle` (here, where the models are fetched
and a package index is reachable) writes build/gpu-check/bundle.tgz; `make gpu-check` there
unpacks and installs it.

    python -m benchmarks.gpu_bundle [--python-version 3.12] [--out build/gpu-check/bundle.tgz]

It holds:
- wheels/: the Python packages the serving code and tests need beyond what a CUDA image with
  PyTorch and transformers brings, at this venv's versions (grpcio and protobuf too: the
  generated code requires the protobuf runtime it was generated for);
- v1/: the generated gRPC code (built here by `make proto`; the other machine has no protoc);
- models/: the default target's and draft's catalog directories without their weights
  (config, tokenizer, manifest): the tests' tiny models take the target's tokenizer, and the
  benchmarks build stand-ins of the same shapes with random weights;
- redis/: this machine's redis-server and the libraries it links (the tests start their own).

There, `place` unpacks it and points an environment at the parts that machine lacks (the
wheels are installed by a stage of the check, which can time out). Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "gpu-check"
DEFAULT_OUT = WORK / "bundle.tgz"
CACHE = Path.home() / ".cache" / "specserve" / "models"  # ServiceSettings' default

# Distributions the serving code and tests import that a CUDA PyTorch image lacks, or whose
# version must be this venv's; their own requirements are on this list or in such an image.
WHEELS = [
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "googleapis-common-protos",
    "redis",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "python-dotenv",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-proto",
    "opentelemetry-semantic-conventions",
    "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-grpc",
    "importlib-metadata",
    "zipp",
    "cryptography",
    "cffi",
    "pycparser",
    "prometheus-client",
    "aiohttp",  # the gateway's HTTP API (imported with the gateway)
    "aiohappyeyeballs",
    "aiosignal",
    "attrs",
    "frozenlist",
    "multidict",
    "propcache",
    "yarl",
    "idna",
    "pytest",  # the tests stage (an image may have none, or older plugins: not loaded there)
    "pluggy",
    "iniconfig",
    "pygments",
    "pytest-timeout",
]
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# Libraries every Linux with a Python has, newer there than here: not copied.
SYSTEM_LIBS = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libstdc++", "libgcc_s")
WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt")


def pinned() -> list[str]:
    """WHEELS as name==version, at the versions installed here (those not installed here are
    not needed by this build)."""
    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return pins


def download_wheels(dest: Path, python_version: str) -> None:
    platforms = [f"--platform={p}" for p in PLATFORMS]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", f"--python-version={python_version}", "--implementation=cp"]
    subprocess.run([*cmd, *platforms, "-d", str(dest), *pinned()], check=True)


def copy_protos(dest: Path) -> None:
    generated = sorted((ROOT / "services" / "v1").glob("*_pb2*.py*"))
    if not generated:
        sys.exit("no generated gRPC code in services/v1: run `make proto` first")
    dest.mkdir(parents=True)
    for path in generated:
        shutil.copy2(path, dest / path.name)


def copy_model_dirs(dest: Path) -> None:
    """The catalog directories of the default target and draft (and of the engine
    benchmark's tiny model, where fetched), weights left out, and roles.json: which is which
    (`{"target": "name/version", ...}`)."""
    from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
    from specserve.engine import models

    from .engine import TINY

    cache = ServiceSettings.load(None).model_cache_dir
    roles = {"target": ModelRef(), "draft": DrafterSettings().draft_model, "tiny": TINY}
    for role, ref in list(roles.items()):
        try:
            path, _ = models.resolve(ref, cache)
        except models.ModelError:
            if role != "tiny":
                raise
            print(f"{ref.label} is not fetched here: the engine benchmark will skip it")
            del roles[role]
            continue
        out = dest / ref.name / ref.version
        out.mkdir(parents=True)
        for file in path.iterdir():
            if file.is_file() and not file.name.endswith(WEIGHTS):
                shutil.copy2(file, out / file.name)
    names = {role: f"{ref.name}/{ref.version}" for role, ref in roles.items()}
    (dest / "roles.json").write_text(json.dumps(names, indent=2) + "\n")


def copy_redis(dest: Path) -> None:
    """redis-server, the shared libraries it links (but the C library's own), and a
    bin/redis-server that runs it with those libraries."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed here (apt-get install redis-server)")
    (dest / "lib").mkdir(parents=True)
    (dest / "bin").mkdir()
    shutil.copy2(Path(binary).resolve(), dest / "redis-server.bin")
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        name, _, where = line.strip().partition(" => ")
        lib = where.split(" (")[0].strip()
        if lib and not name.startswith(SYSTEM_LIBS):
            shutil.copy2(Path(lib).resolve(), dest / "lib" / name)
    wrapper = dest / "bin" / "redis-server"
    wrapper.write_text(
        "#!/bin/sh\n"
        'here="$(dirname "$(readlink -f "$0")")/.."\n'
        'LD_LIBRARY_PATH="$here/lib" exec "$here/redis-server.bin" "$@"\n'
    )
    wrapper.chmod(0o755)


def build(out: Path, python_version: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "bundle"
        print("wheels ...", flush=True)
        download_wheels(root / "wheels", python_version)
        copy_protos(root / "v1")
        print("model directories (no weights) ...", flush=True)
        copy_model_dirs(root / "models")
        copy_redis(root / "redis")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            tar.add(root, arcname="bundle")
    print(f"wrote {out}: {out.stat().st_size / 2**20:.1f} MiB", flush=True)


def place(env: dict[str, str]) -> bool:
    """Unpacks WORK/bundle.tgz (when newer than what was unpacked) and sets `env` to use the
    parts this machine lacks: generated code copied into services/v1, redis-server on PATH,
    the models' directories as MODEL_CACHE_DIR. Returns whether a bundle is there."""
    bundle, packed, stamp = WORK / "bundle", WORK / "bundle.tgz", WORK / "bundle" / ".unpacked"
    if packed.exists() and (not stamp.exists() or stamp.stat().st_mtime < packed.stat().st_mtime):
        shutil.rmtree(bundle, ignore_errors=True)
        with tarfile.open(packed) as tar:
            tar.extractall(WORK, filter="data")
        stamp.touch()
    if not bundle.is_dir():
        return False
    for proto in (bundle / "v1").glob("*"):
        if not (ROOT / "services" / "v1" / proto.name).exists():
            shutil.copy2(proto, ROOT / "services" / "v1" / proto.name)
    if shutil.which("redis-server", path=env.get("PATH")) is None:
        env["PATH"] = os.pathsep.join([str(bundle / "redis" / "bin"), env.get("PATH", "")])
    cache = Path(env.get("MODEL_CACHE_DIR", CACHE))
    target = roles(bundle / "models").get("target", "")
    if target and not (cache / target / "specserve-model.json").exists():
        env["MODEL_CACHE_DIR"] = str(bundle / "models")  # tokenizers and configs, no weights
    return True


def roles(models: Path) -> dict[str, str]:
    """name/version of each bundled model by role (target, draft, tiny)."""
    path = models / "roles.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    build(args.out, args.python_version)


if __name__ == "__main__":
    main()
