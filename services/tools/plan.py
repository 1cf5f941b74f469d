"""`specserve plan`: how much hardware a load needs, from the models' shapes and a device.

Decoding is memory-bound: a step reads every weight once for the whole batch, and each
sequence's KV cache. So the ceiling of one stream's decode speed is bandwidth / bytes read per
step, and speculation multiplies the tokens a step yields by the expected accepted length at
the cost of the draft model's own reads. Prefill is compute-bound: every prompt token goes
through every weight matrix (two FLOPs per parameter), so the time to first token is at
least the prompt's FLOPs / the device's peak FLOP/s. Every figure is labelled: measured (read
off this machine, a weights file, or a running verifier), given (a flag), or assumed (a
preset or a default named here).
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path

USABLE_MEMORY = 0.9  # of a device's memory; the rest is the framework's and activations'
PREFILL_EFFICIENCY = 0.5  # share of peak FLOP/s a prefill reaches (assumed; MFU)
# Bytes per weight; int4 carries a bfloat16 scale and offset per 32 weights. (The embedding of
# a quantised model stays unquantised, left out: decode reads one row of it.)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int4": 0.625}
# Bytes per KV cache element: quantised models keep activations and KV in float32.
KV_BYTES = {**DTYPE_BYTES, "int8": 4, "int4": 4}


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    flops: float  # dense 16-bit matrix multiply FLOP/s (no sparsity)
    count: int = 1
    source: str = "assumed"  # "measured" for this machine


PRESETS = {  # vendor datasheet figures (memory, bandwidth, dense BF16 tensor FLOP/s)
    "h100-80gb": Device("h100-80gb", 80e9, 3.35e12, 989e12),
    "h200": Device("h200", 141e9, 4.8e12, 989e12),
    "a100-80gb": Device("a100-80gb", 80e9, 2.039e12, 312e12),
    "l4": Device("l4", 24e9, 300e9, 121e12),
    "a10g": Device("a10g", 24e9, 600e9, 125e12),  # the A10's figure; the A10G clocks lower
}


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: parameters and the KV cache's width."""

    params: int
    layers: int
    kv_heads: int
    head_dim: int
    source: str  # where params came from
    vocab_size: int = 0
    hidden_size: int = 0
    tied_embeddings: bool = True
    heads: int = 0  # attention heads (0: unknown)
    intermediate_size: int = 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def prefill_flops(self, prompt_tokens: int) -> int:
        """Matrix-multiply FLOPs of a prefill: every token through every weight matrix but
        the embedding table (a lookup) and the LM head (the last token's logits only).
        Attention scores are left out: this is a floor."""
        table = self.vocab_size * self.hidden_size
        per_token = self.params - table * (1 if self.tied_embeddings else 2)
        return 2 * per_token * prompt_tokens + 2 * table


def shape_from_config(config: dict) -> Shape:
    """Parameters of a Llama/Qwen2-style decoder computed from its config.json."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    vocab, inter = config["vocab_size"], config["intermediate_size"]
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden + (q + 2 * kv) * bias
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    params = layers * per_layer + embeddings + hidden
    tied = bool(config.get("tie_word_embeddings"))
    return Shape(
        params,
        layers,
        kv_heads,
        head_dim,
        "computed from config.json",
        vocab,
        hidden,
        tied,
        heads,
        inter,
    )


def shape_from_dir(path: Path) -> Shape:
    """A model directory's shape; parameters counted from its safetensors headers if there."""
    shape = shape_from_config(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return shape
    params = 0
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        params += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return replace(shape, params=params, source="measured: weights file")


def measure_this_machine(
    sample_bytes: int = 1 << 30, dtype: str = "bfloat16", device: str = "cpu"
) -> Device:
    """This machine's `device` (its RAM for the CPU): its memory, its bandwidth measured by
    copying a tensor larger than any cache (bytes read + written per second, best of 5), and
    its matrix multiply FLOP/s in what a prompt's products run in for `dtype` (best of 5
    products of 2048-square matrices on the CPU, 8192-square on a GPU): bfloat16 for the half
    and quantised types, float32 on a CPU without bfloat16 matrix instructions (gemm.py)."""
    import torch

    from ..engine.gemm import HALF, wide_dtype
    from ..engine.models import torch_dtype

    where = torch.device(device)
    if where.type == "cuda":
        memory = float(torch.cuda.get_device_properties(where).total_memory)
    else:
        memory = 0.0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = float(line.split()[1]) * 1024
    best = _copy_seconds(sample_bytes, where)
    n = 8192 if where.type == "cuda" else 2048
    compute = torch_dtype("bfloat16" if dtype in ("int8", "int4") else dtype)
    if compute in HALF and wide_dtype(where.type) == torch.float32:
        compute = torch.float32
    a = torch.randn(n, n, device=where).to(compute)
    a @ a  # warm-up: a GPU's first product also picks its kernel
    fastest = min(_seconds(lambda: a @ a, where) for _ in range(5))
    name = "this-machine" if where.type == "cpu" else f"this-machine {device}"
    return Device(name, memory, 2 * sample_bytes / best, 2 * n**3 / fastest, 1, "measured")


def _copy_seconds(sample_bytes: int, device) -> float:
    """The fastest of 5 copies of `sample_bytes` on `device` (the tensors freed on return)."""
    import torch

    src = torch.ones(sample_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return min(_seconds(lambda: dst.copy_(src), device) for _ in range(5))


def _seconds(work, device) -> float:
    """Wall time of `work` on `device`, waiting for a GPU to finish it."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda *_: None
    sync(device)
    started = time.perf_counter()
    work()
    sync(device)
    return time.perf_counter() - started


def expected_tokens(acceptance: float, depth: int) -> float:
    """Tokens one step yields with a chain of `depth` drafts, each accepted with probability
    `acceptance` given the ones before it: 1 + a + a^2 + ... + a^depth."""
    return sum(acceptance**i for i in range(depth + 1))


@dataclass
class Load:
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    dtype: str = "bfloat16"
    acceptance: float = 0.7  # per draft token
    acceptance_source: str = "assumed"
    target_tokens_per_s: float = 0.0  # per stream; 0: none
    target_ttft_s: float = 0.0  # 0: none
    max_batch: int = 64
    tensor_parallel: int = 0  # devices a verifier spans; 0: the fewest that hold the weights


def plan(target: Shape, draft: Shape | None, device: Device, load: Load) -> dict:
    """The plan as a dict of figures, each {value, source}."""
    b = DTYPE_BYTES[load.dtype]
    weights = target.params * b
    kv_token = target.kv_bytes_per_token(KV_BYTES[load.dtype])
    context = load.prompt_tokens + load.output_tokens
    kv_sequence = kv_token * context
    usable = device.memory_bytes * USABLE_MEMORY
    devices_for_weights = math.ceil(weights / usable)
    # A verifier over n devices (tensor parallel) holds 1/n of the weights and of every
    # sequence's KV on each, and reads them all at once: n times the memory, the bandwidth
    # and the FLOP/s of one (the exchanges between them left out: a ceiling).
    n = load.tensor_parallel or devices_for_weights
    fits = weights <= n * usable
    per_verifier = min(load.max_batch, int((n * usable - weights) // kv_sequence)) if fits else 0
    verifiers = math.ceil(load.concurrency / per_verifier) if per_verifier > 0 else None
    batch = min(per_verifier, math.ceil(load.concurrency / verifiers)) if verifiers else 0
    mean_context = load.prompt_tokens + load.output_tokens / 2

    def step_seconds(batch_size: int) -> float:
        return (weights + batch_size * mean_context * kv_token) / (n * device.bandwidth_bytes_s)

    prefill_floor = target.prefill_flops(load.prompt_tokens) / (device.flops * n)

    out = {
        "target_params": (target.params, target.source),
        "weight_bytes": (weights, "computed"),
        "kv_bytes_per_token": (kv_token, "computed"),
        "kv_bytes_per_sequence": (kv_sequence, "computed"),
        "kv_bytes_for_the_load": (kv_sequence * load.concurrency, "computed"),
        "device": (device.name, device.source),
        "device_memory_bytes": (device.memory_bytes, device.source),
        "device_bandwidth_bytes_s": (device.bandwidth_bytes_s, device.source),
        "fits_one_device": (devices_for_weights == 1, "computed"),
        "devices_per_verifier_needed": (devices_for_weights, "computed"),
        "tensor_parallel": (n, "given" if load.tensor_parallel else "computed"),
        "weights_fit_tensor_parallel": (fits, "computed"),
        "sequences_per_verifier": (per_verifier, "computed"),
        "verifier_replicas": (verifiers, "computed"),
        "devices": ((verifiers or 0) * n, "computed"),
        "plain_decode_ceiling_tokens_s_per_stream": (1 / step_seconds(1), "computed"),
        "plain_decode_tokens_s_per_stream_at_batch": (
            1 / step_seconds(max(1, batch)),
            "computed",
        ),
        "device_flops": (device.flops, device.source),
        "ttft_floor_s": (prefill_floor, "computed"),
        "prefill_efficiency": (PREFILL_EFFICIENCY, "assumed"),
        "ttft_estimate_s": (prefill_floor / PREFILL_EFFICIENCY + step_seconds(batch), "computed"),
        "acceptance_per_draft_token": (load.acceptance, load.acceptance_source),
    }
    if n > 1 and target.heads:
        sizes = (target.heads, target.kv_heads, target.intermediate_size, target.vocab_size)
        out["tensor_parallel_divides_model"] = (all(x % n == 0 for x in sizes), "computed")
    if draft is not None:
        draft_step = draft.params * b / device.bandwidth_bytes_s
        target_step = step_seconds(max(1, batch))
        best = max(
            range(0, 9),
            key=lambda k: expected_tokens(load.acceptance, k) / (target_step + k * draft_step),
        )
        speedup = (
            expected_tokens(load.acceptance, best) * target_step / (target_step + best * draft_step)
        )
        busy = best * draft_step / (target_step + best * draft_step)
        out |= {
            "draft_params": (draft.params, draft.source),
            "draft_depth": (best, "computed"),
            "speculative_speedup": (speedup, "computed"),
            "speculative_tokens_s_per_stream": (speedup / target_step, "computed"),
            "drafter_replicas": (math.ceil((verifiers or 0) * busy), "computed"),
        }
    if load.target_tokens_per_s:
        best_rate = out.get(
            "speculative_tokens_s_per_stream", out["plain_decode_tokens_s_per_stream_at_batch"]
        )
        out["meets_target_tokens_s"] = (best_rate[0] >= load.target_tokens_per_s, "computed")
    if load.target_ttft_s:
        out["meets_target_ttft"] = (out["ttft_estimate_s"][0] <= load.target_ttft_s, "computed")
    return {k: {"value": v, "source": s} for k, (v, s) in out.items()}


def render(result: dict) -> str:
    rows = []
    for name, item in result.items():
        value = item["value"]
        if isinstance(value, float):
            value = f"{value:.4g}"
        rows.append(f"{name:44} {value!s:>22}  {item['source']}")
    return "\n".join(rows)


def as_json(result: dict) -> str:
    return json.dumps(result, indent=2)


def measured_acceptance(metrics_url: str) -> float:
    """Accepted / drafted tokens so far, from a verifier's /metrics page."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (
            "specserve_verifier_accepted_tokens_total",
            "specserve_verifier_drafted_tokens_total",
        ):
            values[name] = float(value)
    drafted = values.get("specserve_verifier_drafted_tokens_total", 0.0)
    if not drafted:
        raise ValueError(f"{metrics_url}: the verifier has drafted nothing yet")
    return values.get("specserve_verifier_accepted_tokens_total", 0.0) / drafted
