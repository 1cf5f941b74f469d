"""How products with big weights run on a CPU: large half-precision calls on CPUs without
bfloat16 matrix instructions (`widen`), and the LM head's layout (`column_major_head`).

On such a CPU (AVX2: AMD EPYC, older Intel) torch multiplies bfloat16 matrices about one row
at a time: one 1536 x 8960 layer, 2 threads, took 3.3 ms for 1 row, 27 ms for 17, 115 ms for
64 and 645 ms for 400, where widening the weights to float32 and running a float32 GEMM took
98 ms for 64 rows and 178 ms for 400 (the widening included). So on those CPUs a half-precision
linear layer runs calls of more than WIDE_ROWS rows (prompt chunks, big batches) in float32,
and fewer rows (decode and tree steps) as before, reading half the bytes. The int8 layers'
GEMM path widens its codes the same way (quant.py). On CUDA and on CPUs with AMX or
AVX512-BF16 nothing changes.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

WIDE_ROWS = 64  # calls of more rows than this run in float32 where `wide_dtype` says so
NATIVE_BF16_CHECKS = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch.cpu's
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def wide_dtype(device_type: str) -> torch.dtype:
    """What a large product of half-precision weights runs in on this kind of device:
    bfloat16 on CUDA and on CPUs with bfloat16 matrix instructions, float32 on other CPUs."""
    if device_type != "cpu":
        return torch.bfloat16
    native = (getattr(torch.cpu, name, lambda: False)() for name in NATIVE_BF16_CHECKS)
    return torch.bfloat16 if any(native) else torch.float32


class WideLinear(nn.Linear):
    """An nn.Linear whose calls of more than WIDE_ROWS rows run in float32 (its weights stay
    in their own dtype; each such call widens them) and return the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= WIDE_ROWS * self.in_features:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def widen(model: nn.Module) -> int:
    """Makes every half-precision nn.Linear of `model` a WideLinear where its device runs
    large products faster in float32; returns how many it changed."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in HALF:
            if wide_dtype(module.weight.device.type) == torch.float32:
                module.__class__ = WideLinear
                changed += 1
    if changed:
        log.info(
            "half-precision linear layers run large calls in float32",
            extra={"layers": changed, "rows_over": WIDE_ROWS, "why": "no bfloat16 matmul here"},
        )
    return changed


@torch.no_grad()
def column_major_head(model: nn.Module) -> bool:
    """Stores a CPU model's float LM head weight [vocab, hidden] column-major (the same
    tensor, its storage transposed; a tied embedding shares it). A decode step multiplies one
    row by it, and CPU BLAS runs that product 3x faster when the weight is hidden-major: the
    36M proxy's [151936, 192] head took 16.0 ms a row stored by rows and 5.1 ms by columns
    (float32, 2 threads; about its read time), and the default draft's [151936, 896] head
    44 ms and 25 ms; at 8 rows and more the two layouts cost the same. An embedding lookup
    from it is a strided gather: 4,096 prompt tokens of 1,536 took 44 ms against 1.8 ms,
    small beside the prompt's forward. Returns whether it changed the layout."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if type(head) not in (nn.Linear, WideLinear) or weight.device.type != "cpu":
        return False
    if not weight.is_floating_point() or weight.stride(0) == 1:
        return False
    weight.data = weight.data.t().contiguous().t()
    return True
