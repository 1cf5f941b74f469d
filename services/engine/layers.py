"""A decoder layer as the flat forward runs it: fewer, larger products and one op a norm.

A Hugging Face Qwen2 / Llama layer is rewritten once, at start (a transform, so the forward
has no branch for it):

- q, k and v are one product (`joined`): the joined layer's weights are the originals'
  concatenated by output channel, and each original keeps a view of its rows, so the model
  holds each weight once and its own forward still works (the reference decoder the tests
  compare against runs it). Every output channel is computed from its own weights as before,
  by the same kernels. One row through the default target's joined int8 q/k/v took 0.10 ms
  against 0.15 ms for the three. Gate and up are joined too where they are int4 (the
  engine's kernel then quantises the activations once: one row took 0.63 against 0.71 ms for
  the two, 4 rows 0.74 against 0.80, 16 the same); in int8 and float32 they stay two
  products (joined, 16 rows took 10% longer in int8: 9.4 against 8.5 ms).
- Rotary positions are applied to q and k in one pass over the joined product's rows.
- cos and sin of the step's positions are looked up in a table (`RotaryTable`), not computed
  from the frequencies every step.
- RMSNorm is torch's own (`F.rms_norm`), one op where the Hugging Face module runs seven.
- On a CPU running float32 activations eagerly, the norms and the rotary positions are the
  engine's own kernels (kernels/layer_cpu.cpp: `CpuOps`), one op each where torch runs about
  ten and six.
- Where every projection is int4 in the engine's CPU layout, a step's layers run as one call of
  the engine's kernel (`Int4Layers`, kernels/layers_cpu.cpp): the same ops, without a Python
  call between them.

On the 36M proxy of the default target these took a verifier step's ATen ops from 1,864 to
1,199 at batch 1 and from 1,954 to 1,289 at batch 64 (greedy; `python -m benchmarks.step_counts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations

from .attention import ABSENT
from .gemm import WideLinear
from .quant import Int4Linear, Int8Linear


class DecoderLayer(nn.Module):
    """One layer's modules, shared with the Hugging Face layer it was made from."""

    def __init__(
        self,
        hf_layer: nn.Module,
        heads: int,
        kv_heads: int,
        head_dim: int,
        ops: TorchOps | CpuOps | None = None,
    ):
        super().__init__()
        self.ops = ops or TorchOps()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = joined([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = mlp.act_fn
        if isinstance(self.gate, Int4Linear):
            self.gate_up = joined([self.gate, self.up])
            self.gated = self._gated_joined
        self.norm_in, self.norm_post = hf_layer.input_layernorm, hf_layer.post_attention_layernorm

    def front(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The layer up to attention: [T, hidden] -> q [T, heads, head_dim], k and v
        [T, kv_heads, head_dim], rotary positions applied (cos, sin: [T, 1, head_dim])."""
        qkv = self.qkv(self.ops.rms_norm(self.norm_in, hidden))
        qkv = qkv.view(hidden.shape[0], self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv.split([self.heads + self.kv_heads, self.kv_heads], dim=1)
        qk = self.ops.rotary(qk, cos, sin)
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        return q, k, v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim] -> [T, hidden]: the attention's output projection."""
        return self.o_proj(attended.reshape(attended.shape[0], -1))

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(self.gated(self.ops.rms_norm(self.norm_post, hidden)))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): the MLP's input to its down projection."""
        return self.act(self.gate(x)) * self.up(x)

    def _gated_joined(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.act(gate) * up

    def back(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after attention: output projection, residuals and the MLP."""
        hidden = hidden + self.out(attended)
        return hidden + self.mlp(hidden)


class RotaryTable:
    """cos and sin by position for a model's rotary embedding, from a table the model's own
    rotary module computes for positions 0..n-1 (grown by doubling as positions need).
    Rope types whose frequencies depend on the length (dynamic, longrope) are computed by the
    module every step, as the model does."""

    PER_STEP = ("dynamic", "longrope")

    def __init__(self, rotary: nn.Module, dtype: torch.dtype, device: torch.device):
        self.rotary = rotary
        self.like = torch.empty(0, dtype=dtype, device=device)
        self.per_step = any(kind in getattr(rotary, "rope_type", "") for kind in self.PER_STEP)
        self.cos = self.sin = self.like.new_empty(0, 1, 0)  # [n, 1, head_dim]

    def __call__(self, positions: torch.Tensor, max_position: int):
        """positions [T] -> cos, sin [T, 1, head_dim]; max_position: the largest of them."""
        if self.per_step:
            cos, sin = self.rotary(self.like, positions[None])
            return cos[0][:, None, :], sin[0][:, None, :]
        if max_position >= self.cos.shape[0]:
            n = max(max_position + 1, 2 * self.cos.shape[0], 256)
            every = torch.arange(n, device=self.like.device)[None]
            cos, sin = self.rotary(self.like, every)  # [1, n, head_dim]
            self.cos, self.sin = cos[0][:, None, :], sin[0][:, None, :]
        return self.cos[positions], self.sin[positions]


class TorchOps:
    """The layer's norms and rotary positions in torch's ops: any device and dtype, and what
    torch.compile fuses."""

    @staticmethod
    def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A Qwen2 / Llama RMSNorm module's function, as one op."""
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)

    @staticmethod
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] with rotary positions applied (cos, sin: [T, 1, head_dim])."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class CpuOps:
    """The same functions in the engine's CPU kernels, for float32 activations: one op each,
    about 2 us for a row where torch's took 10-11 here. Rotary positions give torch's bits;
    a norm's mean of squares is summed in double precision, each row alone (torch's bits on
    one row; on several, within an ulp)."""

    @staticmethod
    def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specserve.rms_norm(x, norm.weight, norm.variance_epsilon)

    @staticmethod
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.ops.specserve.rotary(x, cos, sin)


def layer_ops(hf_model: nn.Module) -> TorchOps | CpuOps:
    """CpuOps on a CPU whose norms are float32 (a float32 model, or a quantised one with
    float32 activations) where the kernels load, eager or compiled (the kernels are opaque
    calls in a compiled graph); TorchOps otherwise."""
    norm = hf_model.model.norm.weight
    if norm.device.type != "cpu" or norm.dtype != torch.float32:
        return TorchOps()
    from . import kernels

    return CpuOps() if kernels.available() else TorchOps()


@torch.no_grad()
def joined(parts: list[nn.Module]) -> nn.Module:
    """One layer computing `parts`' outputs side by side (concatenated on the last dim);
    each part's weights become views of the joined layer's, except int4's scales and
    offsets in torch's layout, which its kernel reads contiguous (a part keeps a copy: 1/4
    of its codes' bytes)."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts) or kind not in JOINERS:
        raise TypeError(f"cannot join {[type(p).__name__ for p in parts]}")
    fused = kind.__new__(kind)
    nn.Module.__init__(fused)
    fused.in_features = parts[0].in_features
    fused.out_features = sum(p.out_features for p in parts)
    fused.bias = _joined_bias(parts)
    JOINERS[kind](fused, parts)
    start = 0
    for part in parts:
        rows = slice(start, start + part.out_features)
        if part.bias is not None:
            part.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        JOINERS[kind].share(fused, part, rows)
        start = rows.stop
    return fused


def _joined_bias(parts) -> nn.Parameter | None:
    if all(p.bias is None for p in parts):
        return None
    like = next(p.bias for p in parts if p.bias is not None)
    biases = [like.new_zeros(p.out_features) if p.bias is None else p.bias for p in parts]
    return nn.Parameter(torch.cat(biases), requires_grad=False)


class _Dense:
    """nn.Linear and WideLinear: the weight [out, in]."""

    def __call__(self, fused, parts) -> None:
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)

    @staticmethod
    def share(fused, part, rows: slice) -> None:
        part.weight = nn.Parameter(fused.weight[rows], requires_grad=False)


class _Int8:
    """Int8Linear: codes [out, in], scales [out]."""

    def __call__(self, fused, parts) -> None:
        fused.register_buffer("codes", torch.cat([p.codes for p in parts]))
        fused.register_buffer("scales", torch.cat([p.scales for p in parts]))

    @staticmethod
    def share(fused, part, rows: slice) -> None:
        part.codes, part.scales = fused.codes[rows], fused.scales[rows]


class _Int4:
    """Int4Linear: packed codes stacked by output channel; scale_offset by output channel in
    the "blocks" layout ([out, in / 256, 16]), [in / G, out, 2] in torch's."""

    def __call__(self, fused, parts) -> None:
        fused.layout = parts[0].layout
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))
        joined_pairs = torch.cat([p.scale_offset for p in parts], dim=_Int4.pairs_dim(fused))
        fused.register_buffer("scale_offset", joined_pairs)

    @staticmethod
    def pairs_dim(layer) -> int:
        return 0 if layer.layout == "blocks" else 1

    @staticmethod
    def share(fused, part, rows: slice) -> None:
        # CUDA's packed layout stacks 8 output channels a row: every part's count divides by 8
        scale = fused.packed.shape[0] / fused.out_features
        part.packed = fused.packed[int(rows.start * scale) : int(rows.stop * scale)]
        if _Int4.pairs_dim(fused) == 0:
            part.scale_offset = fused.scale_offset[rows]


JOINERS = {nn.Linear: _Dense(), WideLinear: _Dense(), Int8Linear: _Int8(), Int4Linear: _Int4()}


class Int4Layers:
    """Every decoder layer of a step as one call of the engine's CPU kernel `int4_layers`
    (kernels/layers_cpu.cpp): the ops of DecoderLayer.front and back, the KV writes and paged
    attention in the same order on the same tensors, so the same bits, with no Python between
    them. For layers that `fits`, a step with one attention group."""

    # (the kernel's order of a layer's tensors: layers_cpu.cpp's Part)
    @staticmethod
    def layer_tensors(layer: DecoderLayer) -> list[torch.Tensor]:
        bias = layer.qkv.bias if layer.qkv.bias is not None else ABSENT
        return [
            layer.norm_in.weight,
            *(layer.qkv.packed, layer.qkv.scale_offset, bias),
            *(layer.o_proj.packed, layer.o_proj.scale_offset),
            layer.norm_post.weight,
            *(layer.gate_up.packed, layer.gate_up.scale_offset),
            *(layer.down.packed, layer.down.scale_offset),
        ]

    @staticmethod
    def fits(layers: list[DecoderLayer]) -> bool:
        """Whether the kernel runs these layers as the Python ones do: the CPU kernels'
        float32 norms, every projection int4 in their layout, no bias but q/k/v's, a SiLU
        MLP, one norm epsilon."""

        def int4(linear, bias_ok: bool = False) -> bool:
            return (
                isinstance(linear, Int4Linear)
                and linear.layout == "blocks"
                and (bias_ok or linear.bias is None)
            )

        return bool(layers) and all(
            isinstance(layer.ops, CpuOps)
            and int4(layer.qkv, bias_ok=True)
            and all(int4(p) for p in (layer.o_proj, getattr(layer, "gate_up", None), layer.down))
            and isinstance(layer.act, _SILU)
            and layer.norm_in.weight.dtype == layer.norm_post.weight.dtype == torch.float32
            and layer.norm_in.variance_epsilon == layers[0].norm_in.variance_epsilon
            and layer.norm_post.variance_epsilon == layers[0].norm_in.variance_epsilon
            for layer in layers
        )

    def __init__(self, layers: list[DecoderLayer]):
        first = layers[0]
        self.heads, self.kv_heads = first.heads, first.kv_heads
        self.eps = first.norm_in.variance_epsilon
        self.scale = first.head_dim**-0.5
        self.weights = [t for layer in layers for t in self.layer_tensors(layer)]

    def __call__(self, pool, batch, hidden, cos, sin) -> torch.Tensor:
        """hidden [T, hidden] -> hidden after every layer; the step's entries written to
        `pool`."""
        (group,) = batch.groups
        return torch.ops.specserve.int4_layers(
            hidden,
            cos,
            sin,
            self.weights,
            pool.keys,
            pool.values,
            batch.write_slots,
            group.slots(hidden.device),
            ABSENT if group.mask is None else group.mask,
            ABSENT if group.output_index is None else group.output_index,
            self.heads,
            self.kv_heads,
            self.eps,
            self.scale,
        )


# SiLU modules: torch's, and the one Hugging Face models build for hidden_act "silu"
_SILU = tuple(c for c in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if c)
