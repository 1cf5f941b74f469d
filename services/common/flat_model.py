"""The forward pass that serves and drafts: many sequences in one flat batch, tree attention.

A Hugging Face Qwen2 / Llama model provides the weights and the per-token modules (embedding,
norms, projections, MLP, rotary embedding); this module owns the attention and the KV cache:

- All new tokens of all sequences go through the linear layers as one [tokens, hidden] matrix.
- Attention runs per sequence against that sequence's own KV buffer, with a boolean mask that
  says which cached and new tokens each new token may see (causal for a prompt; prefix plus
  ancestors for the nodes of a draft tree).
- A sequence's KV lives in one preallocated buffer; progress is a length. Rolling back is
  setting the length; keeping an accepted tree path is copying its few entries down.

Plain Hugging Face forward passes are the reference this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = {"qwen2", "llama"}


class UnsupportedModel(ValueError):
    """The model's architecture is not one this forward implements."""


class SequenceKV:
    """KV buffer of one sequence: `length` positions hold valid entries.

    keys, values: [layers, kv_heads, capacity, head_dim]. Growing doubles the capacity but
    stops at `limit` (the sequence's reservation), when one is set.
    """

    @torch.inference_mode()
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, capacity=64):
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0
        self.limit: int | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, needed: int) -> None:
        """Grows the buffer (doubling) so that `needed` positions fit."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        if self.limit is not None:
            new_cap = max(needed, min(new_cap, self.limit))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], new_cap, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def keep(self, start: int, offsets: list[int]) -> None:
        """Keeps entries start+offsets[i] at start+i and drops everything after them.

        Used after tree verification: the accepted path's nodes move next to the prefix."""
        if offsets != list(range(len(offsets))):
            src = torch.tensor([start + o for o in offsets], device=self.keys.device)
            dst = slice(start, start + len(offsets))
            self.keys[:, :, dst] = self.keys[:, :, src]
            self.values[:, :, dst] = self.values[:, :, src]
        self.length = start + len(offsets)


@dataclass
class Segment:
    """New tokens of one sequence for one forward pass.

    The tokens are written to kv at positions kv.length.., and kv.length grows by their count.
    """

    kv: SequenceKV
    token_ids: list[int]  # [n]
    positions: list[int] | None = None  # [n] rotary positions; None: kv.length + 0..n-1
    visible: torch.Tensor | None = None  # [n, kv.length + n] bool, None: causal
    logits_from: int = -1  # rows >= this get logits (-1: only the last row)


class FlatModel:
    """Runs a Hugging Face causal LM of the Qwen2/Llama family over flat batches of Segments."""

    def __init__(self, hf_model):
        config = hf_model.config
        if config.model_type not in SUPPORTED:
            raise UnsupportedModel(
                f"model type {config.model_type!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED))}"
            )
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise UnsupportedModel("sliding-window attention layers are not supported")
        self.hf = hf_model
        self.body = hf_model.model
        self.layers = list(self.body.layers)
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, param.device

    def new_kv(self, capacity: int = 64, limit: int | None = None) -> SequenceKV:
        if limit is not None:
            capacity = min(capacity, limit)
        kv = SequenceKV(
            len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, capacity
        )
        kv.limit = limit
        return kv

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Logits (float32) for each segment's rows from logits_from on: [rows, vocab] each."""
        ids, positions, masks, spans = [], [], [], []
        start = 0
        for seg in segments:
            n = len(seg.token_ids)
            if n == 0:
                raise ValueError("a segment has no tokens")
            past = seg.kv.length
            seg.kv.reserve(past + n)
            ids.extend(seg.token_ids)
            positions.extend(seg.positions or range(past, past + n))
            masks.append(seg.visible if seg.visible is not None else causal_mask(past, n))
            spans.append((start, n, past))
            start += n
        device = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        masks = [m.to(device) for m in masks]
        hidden = self.body.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.body.rotary_emb(hidden, pos[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, head_dim]
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(
                index, layer, layer.input_layernorm(hidden), cos, sin, segments, spans, masks
            )
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for seg, (_, n, past) in zip(segments, spans, strict=True):
            seg.kv.length = past + n
        hidden = self.body.norm(hidden)
        rows = []
        for seg, (begin, n, _) in zip(segments, spans, strict=True):
            first = n - 1 if seg.logits_from < 0 else seg.logits_from
            rows.append(hidden[begin + first : begin + n])
        logits = self.hf.lm_head(torch.cat(rows)).float()
        return list(torch.split(logits, [r.shape[0] for r in rows]))

    def _attention(self, index, layer, x, cos, sin, segments, spans, masks) -> torch.Tensor:
        attn = layer.self_attn
        tokens = x.shape[0]
        q = attn.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = torch.empty_like(q)
        for seg, (begin, n, past), mask in zip(segments, spans, masks, strict=True):
            kv = seg.kv
            kv.keys[index, :, past : past + n] = k[begin : begin + n].transpose(0, 1)
            kv.values[index, :, past : past + n] = v[begin : begin + n].transpose(0, 1)
            out[begin : begin + n] = F.scaled_dot_product_attention(
                q[begin : begin + n].transpose(0, 1)[None],  # [1, heads, n, head_dim]
                kv.keys[index, :, : past + n][None],
                kv.values[index, :, : past + n][None],
                attn_mask=mask,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return attn.o_proj(out.reshape(tokens, -1))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def causal_mask(past: int, n: int) -> torch.Tensor:
    """[n, past + n] bool: every new token sees the cache and the new tokens up to itself."""
    mask = torch.ones(n, past + n, dtype=torch.bool)
    mask[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    return mask
