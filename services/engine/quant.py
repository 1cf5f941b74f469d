"""Weight-only quantised linear layers, for the CPU and CUDA.

- `int8`: each output channel's weights as int8 codes with one scale (symmetric,
  scale = max |w| / 127); `torch._weight_int8pack_mm` (CPU and CUDA) for calls of up to
  INT8_KERNEL_ROWS rows, a GEMM over the widened codes for larger ones (bfloat16 where the
  device multiplies it natively, float32 on CPUs that do not: gemm.wide_dtype).
- `int4`: each run of INT4_GROUP input weights of an output channel as 4-bit codes with a
  scale and an offset (asymmetric, from the run's min and max). On x86 CPUs with AVX2, the
  engine's own kernel (`kernels.int4_mm`, its block layout); elsewhere packed by
  `_convert_weight_to_int4pack[_for_cpu]` for torch's `_weight_int4pack_mm[_for_cpu]`.

Torch's kernels multiply bfloat16 activations (float32 ones run ~20x slower on the CPU), so a
layer rounds its input to bfloat16; the engine's int4 kernel takes float32 and quantises each
row to int8 per group of 32. Every layer returns float32, and everything else (embeddings,
norms, attention, the KV cache) runs in float32. Every kernel computes each output row from
its own input row alone, so a token's rows through the linear layers do not depend on how many
tokens share its pass, up to INT8_KERNEL_ROWS rows an int8 call (larger calls, prompt chunks, take
the GEMM path). Float32 attention is row-independent on some CPUs and rounds by 1e-7 with the
query count on others, and the LM head's logits are bfloat16, so greedy speculation equals
plain decoding up to ties between the top two logits (docs/design/speculation.md, "What exactly is
promised"). (With bfloat16 attention the default target's speculative output left its plain
decoding at token 12 of 24.)

`quantize` replaces every nn.Linear of a model (the LM head included) in place; `probe` runs
each quantised layer kind once on the model's device against its dequantised weights, so a
build whose kernel is missing or wrong there fails at start, not at the first request.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch import nn

from . import kernels
from .gemm import wide_dtype

log = logging.getLogger(__name__)

QUANTISED = ("int8", "int4")
INT4_GROUP = 32  # input weights per scale/offset pair (the kernels take 32, 64, 128, 256)
CUDA_INNER_K_TILES = 8  # the CUDA int4 layout's tiling; needs in_features % 128 == 0
KERNEL_DTYPE = torch.bfloat16  # what the kernels multiply: activations, scales, offsets
ROWS = 4096  # output channels quantised at a time (bounds the float32 temporaries)
# Most rows an int8 call sends through the int8 kernel. The kernel is built for decode: its
# cost grows with every row (on an Intel CPU with AMX 17 rows cost 5x one row, 400 rows 67x),
# where a dense GEMM's barely does. Larger calls (prompt chunks, big batches) widen the codes
# (exact: |code| <= 127) and run a GEMM, then scale its output. One sequence's decode or tree
# step stays within the limit, so its rows stay those of plain decoding.
INT8_KERNEL_ROWS = 64


class QuantError(ValueError):
    """A model cannot be quantised as asked (shape, device or kernel)."""


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> codes [out, in] int8, scales [out] with w ~ codes * scales."""
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def int4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] float -> codes [out, in] int32 in 0..15, scales and offsets [out, in / G]
    with w ~ (codes - 8) * scale + offset in each run of G = INT4_GROUP inputs."""
    out, inputs = w.shape
    if inputs % INT4_GROUP:
        raise QuantError(f"int4 needs in_features divisible by {INT4_GROUP}; a layer has {inputs}")
    groups = w.reshape(out, -1, INT4_GROUP)  # [out, in / G, G]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, in / G]
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return codes.to(torch.int32).reshape(out, inputs), scales, low + 8 * scales


def int4_dequantized(codes, scales, offsets) -> torch.Tensor:
    out, inputs = codes.shape
    groups = codes.reshape(out, -1, INT4_GROUP).float() - 8  # [out, in / G, G]
    return (groups * scales[..., None] + offsets[..., None]).reshape(out, inputs)


def by_rows(convert, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """convert(float32 rows) for ROWS output channels at a time, results joined on dim 0
    (every quantity here is per output channel, and both kernels' packed layouts stack)."""
    parts = [convert(weight[i : i + ROWS].float()) for i in range(0, weight.shape[0], ROWS)]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


class Int8Linear(nn.Module):
    """y = x @ (codes * scales).T + bias, int8 codes with one scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scales = by_rows(int8_codes, linear.weight.detach())
        self.register_buffer("codes", codes)  # [out, in] int8
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))  # [out]
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if flat.shape[0] <= INT8_KERNEL_ROWS:
            y = torch._weight_int8pack_mm(flat, self.codes, self.scales)
        else:
            wide = wide_dtype(flat.device.type)  # (either multiplies the kernel's inputs)
            y = nn.functional.linear(flat.to(wide), self.codes.to(wide)) * self.scales.to(wide)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ ((codes - 8) * scale + offset).T + bias, a scale/offset per INT4_GROUP inputs.

    On x86 CPUs with AVX2 the codes are kept in the engine's own block layout for
    `kernels.int4_mm` (`layout == "blocks"`): a row through a 1536 x 8960 layer 3x faster
    than torch's CPU kernel; it takes float32 activations (quantised per group of 32 to
    int8). Elsewhere, or with SPECSERVE_INT4_KERNEL=torch, torch's int4 kernels
    (`layout == "torch"`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.layout = int4_layout(linear.weight.device)
        if self.layout == "blocks":  # the kernels' own quantiser (kernels.int4_quantize)
            packed, pairs = kernels.int4_quantize(linear.weight.detach())
            self.register_buffer("packed", packed)  # [out, padded in / 2] uint8
            self.register_buffer("scale_offset", pairs)  # [out, padded in / 256, 16]
        else:

            def convert(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
                codes, scales, offsets = int4_codes(rows)
                return _pack_int4(codes), scales.to(KERNEL_DTYPE), offsets.to(KERNEL_DTYPE)

            packed, scales, offsets = by_rows(convert, linear.weight.detach())
            pairs = torch.stack([scales, offsets], dim=-1).transpose(0, 1)  # [in / G, out, 2]
            self.register_buffer("scale_offset", pairs.contiguous())
            self.register_buffer("packed", packed)  # the kernel's own layout
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.layout == "blocks":
            y = kernels.int4_mm(flat.float(), self.packed, self.scale_offset)  # (pads itself)
        elif self.packed.is_cuda:
            flat = flat.to(KERNEL_DTYPE)
            y = torch._weight_int4pack_mm(flat, self.packed, INT4_GROUP, self.scale_offset)
        else:
            flat = flat.to(KERNEL_DTYPE)
            y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_offset)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def int4_layout(device: torch.device) -> str:
    """ "blocks" (the engine's kernel) on x86 CPUs with AVX2 where it builds, else "torch";
    SPECSERVE_INT4_KERNEL=torch asks for torch's kernel anyway (to compare the two)."""
    if device.type != "cpu" or os.environ.get("SPECSERVE_INT4_KERNEL") == "torch":
        return "torch"
    try:
        kernels.load()
    except kernels.KernelError as e:
        _warn_once(f"int4 layers use torch's kernel: {e}")
        return "torch"
    return "blocks"


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int32 in 0..15 (on the target device) -> the kernel's packed layout."""
    if codes.is_cuda:
        if codes.shape[1] % (16 * CUDA_INNER_K_TILES):
            raise QuantError(
                f"int4 on cuda needs in_features divisible by {16 * CUDA_INNER_K_TILES}; "
                f"a layer has {codes.shape[1]}"
            )
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [out, in / 2]
        return torch._convert_weight_to_int4pack(pairs, CUDA_INNER_K_TILES)
    return torch._convert_weight_to_int4pack_for_cpu(codes, 1)


def _bias(linear: nn.Linear) -> nn.Parameter | None:
    if linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().float(), requires_grad=False)


LAYERS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear}


@torch.no_grad()
def quantize(model: nn.Module, kind: str) -> nn.Module:
    """Replaces every nn.Linear of `model` by its `kind` layer and casts the rest to float32.

    Each layer is quantised from the weights as loaded, on the model's device, one at a time
    (its original is freed as the next one is converted)."""
    layer = LAYERS[kind]
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer(getattr(parent, child)))
    for module in model.modules():  # the rest to float32; the layers keep their kernel's dtypes
        if not isinstance(module, tuple(LAYERS.values())):
            module._apply(lambda t: t.float() if t.is_floating_point() else t, recurse=False)
    blocks = [m for m in model.modules() if isinstance(m, Int4Linear) and m.layout == "blocks"]
    if blocks:  # the engine's kernel: its fastest path by rows, timed on the model's layers
        started = time.perf_counter()
        paths = kernels.choose_int4_path([(m.packed, m.scale_offset) for m in blocks])
        log.info(
            "int4 kernel path chosen",
            extra={
                "path_from_rows": paths,
                "layers": len(blocks),
                "seconds": round(time.perf_counter() - started, 2),
            },
        )
    return model


def kind_of(model: nn.Module) -> str | None:
    """ "int8" / "int4" where quantize converted the model's linear layers, else None."""
    for module in model.modules():
        for kind, layer in LAYERS.items():
            if isinstance(module, layer):
                return kind
    return None


@torch.no_grad()
def probe(kind: str, device: str) -> None:
    """Quantises a small seeded layer on `device` (more than ROWS outputs, so its packed
    chunks are joined), runs it and compares the result with a float32 matmul by the weights
    its codes encode; raises QuantError when this build has no kernel for `kind` there or
    its kernel disagrees."""
    gen = torch.Generator().manual_seed(0)
    out = ROWS + 64
    linear = nn.Linear(256, out)
    linear.weight.copy_(torch.randn(out, 256, generator=gen) * 0.05)
    linear.bias.copy_(torch.randn(out, generator=gen) * 0.05)
    # [rows, in], exact in the kernels' dtype; rows past INT8_KERNEL_ROWS take int8's GEMM path
    x = torch.randn(3 + INT8_KERNEL_ROWS + 1, 256, generator=gen).to(KERNEL_DTYPE).float()
    w = linear.weight.float()
    if kind == "int8":
        codes, scales = int8_codes(w)
        weights = codes.float() * scales[:, None]  # [out, in]
    else:
        weights = int4_dequantized(*int4_codes(w))
    expected = x @ weights.t() + linear.bias  # [rows, out]
    try:
        layer = LAYERS[kind](linear.to(device))
        got = torch.cat([layer(x[:3].to(device)), layer(x[3:].to(device))]).cpu()
    except (RuntimeError, AssertionError, NotImplementedError) as e:  # no kernel, no device
        raise QuantError(f"this torch build has no {kind} kernel there ({e})") from e
    err = (got - expected).abs().max().item()
    tolerance = 0.02 * expected.abs().max().item()
    if not err <= tolerance:
        raise QuantError(
            f"this torch build's {kind} kernel there is off by {err:.3g} "
            f"(tolerance {tolerance:.3g})"
        )
