"""Attention of one layer for a whole step: one scaled-dot-product call per group of sequences.

New tokens' keys and values are written to their pool slots; then each sequence's entries are
read through its slots into a padded [B, kv_heads, Lmax, head_dim] batch (a view when there is
one sequence with contiguous slots), queries are padded to [B, heads, Nmax, head_dim], and one
SDPA call with the group's mask computes its rows; a step has one group, or two when it mixes
prompt chunks with decode tokens and trees (batch.py). Why this kernel and not FlexAttention or a
per-sequence loop: docs/design/engine.md ("Attention kernel").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import AttentionGroup, Batch
from .kv_cache import KVPool


def write_kv(pool: KVPool, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim], the new tokens' entries, stored at their slots."""
    pool.keys[layer].index_copy_(0, batch.write_slots, k)
    pool.values[layer].index_copy_(0, batch.write_slots, v)


def attend(pool: KVPool, layer: int, batch: Batch, q: torch.Tensor) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], every new token attending to the
    entries the step's mask lets it see (its KV must be written first): one call per group."""
    return by_group(attend_group, pool, layer, batch, q)


def by_group(kernel, pool: KVPool, layer: int, batch: Batch, q: torch.Tensor) -> torch.Tensor:
    """`kernel(pool, layer, group, q of its rows)` for each of the step's groups, the results
    put back in batch order."""
    if len(batch.groups) == 1:
        return kernel(pool, layer, batch.groups[0], q)
    out = torch.empty_like(q)
    for group in batch.groups:
        out[group.rows] = kernel(pool, layer, group, q[group.rows])
    return out


def attend_group(pool: KVPool, layer: int, group: AttentionGroup, q: torch.Tensor) -> torch.Tensor:
    """q: [t, heads, head_dim], the group's new tokens in batch order -> the same shape."""
    b, n_max, _ = group.shape
    keys, values = read_kv(pool, layer, group)  # [B, kv_heads, Lmax, head_dim]
    if group.query_index is None:  # one sequence: no padding
        queries = q.transpose(0, 1)[None]  # [1, heads, t, head_dim]
    else:
        queries = q[group.query_index].view(b, n_max, *q.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=group.mask, enable_gqa=True
    )  # [B, heads, Nmax, head_dim]
    out = out.transpose(1, 2).reshape(b * n_max, *q.shape[1:])
    return out if group.output_index is None else out[group.output_index]


def read_kv(pool: KVPool, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's sequences' entries: two [B, kv_heads, Lmax, head_dim] tensors."""
    b, _, l_max = group.shape
    if group.kv_range is not None:
        first, length = group.kv_range
        keys = pool.keys[layer, first : first + length]
        values = pool.values[layer, first : first + length]
    else:
        slots = group.kv_slots.flatten()
        keys = pool.keys[layer].index_select(0, slots)
        values = pool.values[layer].index_select(0, slots)
    shape = (b, l_max, *keys.shape[1:])
    return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)


def attend_paged(pool: KVPool, layer: int, batch: Batch, q: torch.Tensor) -> torch.Tensor:
    """attend's result through the engine's CPU kernel (kernels/attention_cpu.cpp): each
    sequence's entries read in place through its slots, masked entries skipped, no padding."""
    return by_group(paged_group, pool, layer, batch, q)


def paged_group(pool: KVPool, layer: int, group: AttentionGroup, q: torch.Tensor) -> torch.Tensor:
    return torch.ops.specserve.paged_attention(
        q,
        pool.keys[layer],
        pool.values[layer],
        group.slots(q.device),
        ABSENT if group.mask is None else group.mask,
        ABSENT if group.output_index is None else group.output_index,
        q.shape[-1] ** -0.5,
    )


ABSENT = torch.empty(0, dtype=torch.long)  # (the kernels' "no mask", "no row index", "no bias")
