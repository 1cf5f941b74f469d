"""Which dtype a model serves in when its setting is `auto`: the fastest the device runs.

- CUDA: bfloat16 (float16 where the device has no bfloat16): tensor cores multiply it, and a
  batch of sequences reads the weights once however many rows it holds.
- CPU: each candidate the device runs (int4 and int8 where this torch build has their kernels,
  checked by `quant.probe`; bfloat16 where the CPU multiplies it natively, AMX or AVX512-BF16;
  float32) is timed on one decode row through a layer of the model's own MLP shape, and the
  fastest wins. A decode step on a CPU reads every weight once per token, so the fewest bytes
  usually win: on an AMD EPYC with AVX512-BF16, 2 threads, the default target decoded at 17.6
  tokens/s in int4, 8.6 in int8 and 5.1 in bfloat16 (`python -m benchmarks.engine --parts
  decode`). Speculation's trees cost int4 more per row (a 16-node tree 7.2x one token, where
  bfloat16 takes 1.4x), which the adaptive policy prices per step; the plain decode rate is
  what a stream gets when no draft is worth its verification, so that is what is compared.

Every candidate computes a token's row from its own input alone, so speculation stays exact
against plain decoding in whichever dtype wins. The choice and every timing are logged, and the
served version names the dtype chosen (models.served_version).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from . import quant
from .gemm import wide_dtype

log = logging.getLogger(__name__)

CPU_CANDIDATES = ("int4", "int8", "bfloat16", "float32")
FOOTPRINT = 256 << 20  # bytes of weights a timed pass reads (past any CPU's last-level cache) ...
MAX_COPIES = 64  # ... in at most this many copies of the layer (a tiny model's stay in cache)
# Rounds of one timed pass per candidate, after one warm-up: the fastest pass of each counts.
# The candidates take turns within each round, so that a spell of other work on the same cores
# (the drafter choosing its own dtype or quantising, as the cluster starts) slows them alike:
# timed one after another, int4 once took 7.6 ms a row under a drafter's start and float32,
# timed after it, 3.3 ms, and the verifier served float32 at a fifth of int4's speed.
ROUNDS = 9


@dataclass
class Choice:
    dtype: str
    reason: str
    ms_per_row: dict[str, float] = field(default_factory=dict)  # CPU: each candidate timed
    refused: dict[str, str] = field(default_factory=dict)  # candidates the device cannot run


def choose(device: str, in_features: int, out_features: int) -> Choice:
    """The dtype `auto` stands for on `device`, for a model whose MLP layers are
    [out_features, in_features]."""
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return Choice("bfloat16", "cuda: bfloat16 tensor cores")
        return Choice("float16", "cuda without bfloat16: float16")
    refused = {d: why for d in CPU_CANDIDATES if (why := _cannot_run(d, device, in_features))}
    runnable = [d for d in CPU_CANDIDATES if d not in refused]
    timings = _ms_per_row(_layer(in_features, out_features), runnable, device)
    best = min(timings, key=timings.get)
    shown = ", ".join(f"{d} {ms:.2f} ms" for d, ms in timings.items())
    reason = f"fastest decode row through a {out_features}x{in_features} layer ({shown})"
    return Choice(best, reason, timings, refused)


def _cannot_run(dtype: str, device: str, in_features: int) -> str:
    """Why `dtype` is not a candidate on this CPU ("" if it is)."""
    if dtype in quant.QUANTISED:
        if dtype == "int4" and in_features % quant.INT4_GROUP:
            return f"in_features {in_features} is not a multiple of {quant.INT4_GROUP}"
        try:
            quant.probe(dtype, device)
        except quant.QuantError as e:
            return str(e)
    if dtype == "bfloat16" and wide_dtype("cpu") != torch.bfloat16:
        return "no bfloat16 matrix instructions (AMX or AVX512-BF16)"
    return ""


def _layer(in_features: int, out_features: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.02)
    return layer


@torch.no_grad()
def _ms_per_row(layer: nn.Linear, dtypes: list[str], device: str) -> dict[str, float]:
    """Milliseconds of one row through `layer` in each of `dtypes` (its fastest pass), read
    from memory: the row goes through copies of the layer holding at least FOOTPRINT bytes
    together (one layer alone would be timed out of the CPU's cache; decoding reads a model
    far larger). The candidates take turns, ROUNDS times."""
    runs = {dtype: _copies(layer, dtype, device) for dtype in dtypes}
    best = dict.fromkeys(dtypes, float("inf"))
    for i in range(ROUNDS + 1):
        for dtype in dtypes[i % len(dtypes) :] + dtypes[: i % len(dtypes)]:  # (who goes first)
            copies, x = runs[dtype]
            started = time.perf_counter()
            for timed in copies:
                timed(x)
            if i:  # (the first round warms up)
                best[dtype] = min(best[dtype], (time.perf_counter() - started) / len(copies))
    return {dtype: 1000 * best[dtype] for dtype in dtypes}


def _copies(layer: nn.Linear, dtype: str, device: str) -> tuple[list[nn.Module], torch.Tensor]:
    """`layer` in `dtype`, copied to hold FOOTPRINT bytes (at most MAX_COPIES), and a row."""
    if dtype in quant.QUANTISED:
        first = quant.LAYERS[dtype](layer).to(device)
        x = torch.randn(1, layer.in_features, device=device)
    else:
        kind = getattr(torch, dtype)
        first = nn.Linear(layer.in_features, layer.out_features, bias=False)
        first.weight = nn.Parameter(layer.weight.detach().to(device, kind), requires_grad=False)
        x = torch.randn(1, layer.in_features, device=device, dtype=kind)
    size = sum(t.numel() * t.element_size() for t in [*first.parameters(), *first.buffers()])
    extra = min(-(-FOOTPRINT // size), MAX_COPIES) - 1
    return [first] + [copy.deepcopy(first) for _ in range(extra)], x
