"""Attention of one layer for a whole step: one scaled-dot-product call over every sequence.

New tokens' keys and values are written to their pool slots; then each sequence's entries are
read through its slots into a padded [B, kv_heads, Lmax, head_dim] batch (a view when there is
one sequence with contiguous slots), queries are padded to [B, heads, Nmax, head_dim], and one
SDPA call with the step's mask computes every row. Why this kernel and not FlexAttention or a
per-sequence loop: docs/architecture.md ("Attention").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import Batch
from .kv_cache import KVPool


def write_kv(pool: KVPool, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim], the new tokens' entries, stored at their slots."""
    pool.keys[layer].index_copy_(0, batch.write_slots, k)
    pool.values[layer].index_copy_(0, batch.write_slots, v)


def attend(pool: KVPool, layer: int, batch: Batch, q: torch.Tensor) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], every new token attending to the
    entries the step's mask lets it see (its KV must be written first)."""
    b, n_max, l_max = batch.shape
    keys, values = read_kv(pool, layer, batch)  # [B, kv_heads, Lmax, head_dim]
    if batch.query_index is None:  # one sequence: no padding
        queries = q.transpose(0, 1)[None]  # [1, heads, T, head_dim]
    else:
        queries = q[batch.query_index].view(b, n_max, *q.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=batch.mask, enable_gqa=True
    )  # [B, heads, Nmax, head_dim]
    out = out.transpose(1, 2).reshape(b * n_max, *q.shape[1:])
    return out if batch.output_index is None else out[batch.output_index]


def read_kv(pool: KVPool, layer: int, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's sequences' entries: two [B, kv_heads, Lmax, head_dim] tensors."""
    b, _, l_max = batch.shape
    if batch.kv_range is not None:
        first, length = batch.kv_range
        keys = pool.keys[layer, first : first + length]
        values = pool.values[layer, first : first + length]
    else:
        slots = batch.kv_slots.flatten()
        keys = pool.keys[layer].index_select(0, slots)
        values = pool.values[layer].index_select(0, slots)
    shape = (b, l_max, *keys.shape[1:])
    return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
