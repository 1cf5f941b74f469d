"""One step's attention inputs over a block KV pool, and the kernels the benchmark compares.

A step is a list of sequences, each with `past` cached tokens and `new` tokens in this pass
(a prompt chunk, a decode token, or a pending token plus draft-tree nodes). KV lives in a block
pool, per layer [slots, kv_heads, head_dim]; position p of a sequence is at slot
table[p // BLOCK] * BLOCK + p % BLOCK. The new tokens' K/V are already in the pool, as the
engine writes them before attention. Every kernel returns [T, heads, head_dim] over the packed
new tokens of all sequences, and all compute the same attention.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK = 16  # pool block size, tokens


@dataclass(frozen=True)
class Seq:
    past: int  # cached tokens
    new: int  # tokens of this pass
    tree: bool = False  # new = pending token + draft nodes, visible by ancestry


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


@dataclass
class Case:
    """Inputs of one layer for one step."""

    seqs: list[Seq]
    q: torch.Tensor  # [T, heads, head_dim], packed new tokens
    pool_k: torch.Tensor  # [slots, kv_heads, head_dim]
    pool_v: torch.Tensor  # [slots, kv_heads, head_dim]
    tables: list[list[int]]  # per sequence: its blocks
    ancestry: list[torch.Tensor | None]  # per sequence: [new, new] bool for trees
    bits: list[list[int]]  # per sequence: ancestor-or-self bitmask of each new token (trees)
    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # per-sequence KV, [kv_heads, cap, d]
    dense: tuple[torch.Tensor, torch.Tensor]  # contiguous padded KV, [B, kv_heads, Lmax, d]


def random_tree(new: int, rng: random.Random) -> tuple[torch.Tensor, list[int]]:
    """[new, new] ancestor-or-self matrix of a random tree rooted at token 0, and its bitmasks."""
    bits = [1]
    for node in range(1, new):
        bits.append(bits[rng.randrange(node)] | (1 << node))
    anc = torch.tensor([[(b >> j) & 1 for j in range(new)] for b in bits], dtype=torch.bool)
    return anc, bits


def slots_of(table: list[int], length: int) -> torch.Tensor:
    """[length] pool slots of positions 0..length-1."""
    blocks = torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)  # [blocks, BLOCK]
    return blocks.flatten()[:length]


def make_case(
    seqs: list[Seq], shape: Heads, dtype: torch.dtype, seed: int = 0, device: str = "cpu"
) -> Case:
    """Random inputs, drawn on the host (the same on every device), held on `device`."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [s.past + s.new for s in seqs]
    counts = [-(-length // BLOCK) for length in lengths]
    order = list(range(sum(counts) + 4))
    rng.shuffle(order)  # blocks scattered over the pool, as after some churn
    tables, start = [], 0
    for count in counts:
        tables.append(order[start : start + count])
        start += count
    kv_shape = (len(order) * BLOCK, shape.kv_heads, shape.head_dim)
    pool_k = torch.randn(kv_shape, generator=gen).to(dtype)
    pool_v = torch.randn(kv_shape, generator=gen).to(dtype)
    tokens = sum(s.new for s in seqs)
    q = torch.randn(tokens, shape.heads, shape.head_dim, generator=gen).to(dtype)
    ancestry, bits, buffers = [], [], []
    for seq, table, length in zip(seqs, tables, lengths, strict=True):
        anc, tree_bits = random_tree(seq.new, rng) if seq.tree else (None, [0] * seq.new)
        ancestry.append(anc)
        bits.append(tree_bits)
        slots = slots_of(table, length)
        pair = []
        for pool in (pool_k, pool_v):
            buf = pool.new_zeros(shape.kv_heads, length + 64, shape.head_dim)
            buf[:, :length] = pool[slots].transpose(0, 1)
            pair.append(buf)
        buffers.append((pair[0], pair[1]))
    lmax = max(lengths)
    dense = []
    for index in (0, 1):
        pad = pool_k.new_zeros(len(seqs), shape.kv_heads, lmax, shape.head_dim)
        for b, length in enumerate(lengths):
            pad[b, :, :length] = buffers[b][index][:, :length]
        dense.append(pad)
    pool_k, pool_v, q = pool_k.to(device), pool_v.to(device), q.to(device)
    buffers = [(k.to(device), v.to(device)) for k, v in buffers]
    dense = [d.to(device) for d in dense]
    return Case(seqs, q, pool_k, pool_v, tables, ancestry, bits, buffers, (dense[0], dense[1]))


# 1. One SDPA per sequence over its own KV buffer, dense host-built mask (the reference: the
# per-sequence FlatModel before the block pool).


def causal_mask(past: int, n: int) -> torch.Tensor:
    """[n, past + n] bool: every new token sees the cache and the new tokens up to itself."""
    mask = torch.ones(n, past + n, dtype=torch.bool)
    mask[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    return mask


def host_masks(case: Case) -> list[torch.Tensor]:
    """Per step: [new, past + new] bool per sequence, as the per-sequence FlatModel built them."""
    masks = []
    for seq, anc in zip(case.seqs, case.ancestry, strict=True):
        if anc is None:
            masks.append(causal_mask(seq.past, seq.new))
        else:
            mask = torch.ones(seq.new, seq.past + seq.new, dtype=torch.bool)
            mask[:, seq.past :] = anc
            masks.append(mask)
    return masks


def per_sequence(case: Case, masks: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty_like(case.q)  # [T, heads, d]
    begin = 0
    for seq, (keys, values), mask in zip(case.seqs, case.buffers, masks, strict=True):
        n, length = seq.new, seq.past + seq.new
        out[begin : begin + n] = F.scaled_dot_product_attention(
            case.q[begin : begin + n].transpose(0, 1)[None],  # [1, heads, n, d]
            keys[:, :length][None],
            values[:, :length][None],
            attn_mask=mask.to(keys.device),  # (built on the host, as that FlatModel did)
            enable_gqa=True,
        )[0].transpose(0, 1)
        begin += n
    return out


# 2. Padded batch: one SDPA over [B, heads, Nmax, d], K/V gathered from the pool.


@dataclass
class Padded:
    slots: torch.Tensor  # [B, Lmax] pool slot of each key (0 past a sequence's end)
    mask: torch.Tensor  # [B, 1, Nmax, Lmax] bool
    rows: tuple[torch.Tensor, torch.Tensor]  # ([t] batch index, [t] row) of each new token
    tokens: torch.Tensor  # [t] rows of case.q that this call covers


def padded_plan(case: Case, members: list[int] | None = None) -> Padded:
    """Per step: slot table and mask of one call over `members` (default: all sequences),
    built on the device from (past, new) per sequence."""
    members = list(range(len(case.seqs))) if members is None else members
    seqs = [case.seqs[i] for i in members]
    past = torch.tensor([s.past for s in seqs])  # [B]
    new = torch.tensor([s.new for s in seqs])  # [B]
    lengths = past + new
    nmax, lmax = int(new.max()), int(lengths.max())
    width = max(len(case.tables[i]) for i in members)
    tables = torch.tensor([case.tables[i] + [0] * (width - len(case.tables[i])) for i in members])
    pos = torch.arange(lmax)
    slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # [B, Lmax]
    slots = torch.where(pos < lengths[:, None], slots, 0)
    row = torch.arange(nmax)
    mask = pos[None, None, :] <= past[:, None, None] + row[None, :, None]  # [B, Nmax, Lmax]
    mask &= (row[None, :] < new[:, None])[:, :, None]
    mask[:, :, 0] |= row[None, :] >= new[:, None]  # padded rows see key 0
    for b, i in enumerate(members):
        seq, anc = case.seqs[i], case.ancestry[i]
        if anc is not None:
            mask[b, : seq.new, seq.past : seq.past + seq.new] = anc
    batch = torch.repeat_interleave(torch.arange(len(seqs)), new)  # [t]
    rows = torch.arange(int(new.sum())) - (torch.cumsum(new, 0) - new)[batch]
    firsts = torch.tensor([sum(s.new for s in case.seqs[:i]) for i in members])
    device = case.q.device
    return Padded(
        slots.to(device),
        mask[:, None].to(device),
        (batch.to(device), rows.to(device)),
        (firsts[batch] + rows).to(device),
    )


def padded(
    case: Case, plan: Padded, gather: bool = True, expand: bool = False, backend=None
) -> torch.Tensor:
    """[t, heads, d] for plan.tokens; gather=False reads case.dense (all sequences' plan only).
    expand: K/V heads repeated to the query heads, where SDPA's grouped-query path
    (enable_gqa) is refused by a kernel (CUDA's memory-efficient one); backend: the only
    SDPA backend allowed (torch.nn.attention.SDPBackend; None: SDPA's own choice)."""
    batch, rows = plan.rows
    b, _, nmax, _ = plan.mask.shape
    q = case.q.new_zeros(b, nmax, *case.q.shape[1:])
    q[batch, rows] = case.q[plan.tokens]
    if gather:
        k = case.pool_k[plan.slots].transpose(1, 2)  # [B, kv_heads, Lmax, d]
        v = case.pool_v[plan.slots].transpose(1, 2)
    else:
        k, v = case.dense
    if expand:
        group = q.shape[2] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=plan.mask, enable_gqa=not expand
        )  # [B, heads, Nmax, d]
    return out.transpose(1, 2)[batch, rows]


def grouped_plans(case: Case, short: int = 64) -> list[Padded]:
    """One padded call for the sequences with at most `short` new tokens (decode, trees), one
    for the longer ones (prompt chunks), so that a chunk does not pad every tree to its size."""
    groups = [
        [i for i, s in enumerate(case.seqs) if s.new <= short],
        [i for i, s in enumerate(case.seqs) if s.new > short],
    ]
    return [padded_plan(case, group) for group in groups if group]


def padded_grouped(case: Case, plans: list[Padded]) -> torch.Tensor:
    out = torch.empty_like(case.q)  # [T, heads, d]
    for plan in plans:
        out[plan.tokens] = padded(case, plan)
    return out


# 3. FlexAttention over the packed batch.


@dataclass
class Packed:
    slots: torch.Tensor  # [S] pool slots of every sequence's keys, back to back
    block_mask: BlockMask


def packed_plan(case: Case, compile_mask: bool = False) -> Packed:
    """Per step: packed slots and the block mask over (sequence, position, tree ancestry).

    compile_mask: build the block mask with a compiled mask function (create_block_mask's
    _compile) instead of evaluating mask_mod over the whole [T, S] grid eagerly."""
    device = case.q.device
    past = torch.tensor([s.past for s in case.seqs], device=device)  # [B]
    new = torch.tensor([s.new for s in case.seqs], device=device)  # [B]
    lengths = past + new
    ids = torch.arange(len(case.seqs), device=device)
    kv_seq = torch.repeat_interleave(ids, lengths)  # [S]
    kv_pos = torch.arange(int(lengths.sum()), device=device)
    kv_pos -= (torch.cumsum(lengths, 0) - lengths)[kv_seq]
    q_seq = torch.repeat_interleave(ids, new)  # [T]
    q_past = past[q_seq]
    q_pos = torch.arange(int(new.sum()), device=device) - (torch.cumsum(new, 0) - new)[q_seq]
    q_pos += q_past
    q_bits = torch.tensor(
        [b for bits in case.bits for b in bits], dtype=torch.int64, device=device
    )  # [T]

    def mask_mod(b, h, q_idx, kv_idx):
        kp, start, bits = kv_pos[kv_idx], q_past[q_idx], q_bits[q_idx]
        in_tree = ((bits >> (kp - start).clamp(0, 62)) & 1) == 1
        sees = (kp < start) | torch.where(bits != 0, in_tree, kp <= q_pos[q_idx])
        return (q_seq[q_idx] == kv_seq[kv_idx]) & sees

    slots = torch.cat(
        [slots_of(t, s.past + s.new) for t, s in zip(case.tables, case.seqs, strict=True)]
    ).to(device)
    block_mask = create_block_mask(
        mask_mod, None, None, len(q_seq), len(kv_seq), device=device, _compile=compile_mask
    )
    return Packed(slots, block_mask)


def packed_flex(case: Case, plan: Packed, flex=flex_attention) -> torch.Tensor:
    """flex: flex_attention, or a torch.compile of it."""
    k = case.pool_k[plan.slots].transpose(0, 1)[None]  # [1, kv_heads, S, d]
    v = case.pool_v[plan.slots].transpose(0, 1)[None]
    q = case.q.transpose(0, 1)[None]  # [1, heads, T, d]
    out = flex(q, k, v, block_mask=plan.block_mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def nested_probe(case: Case) -> str:
    """Whether SDPA over jagged nested tensors runs this step's attention with its mask."""
    q = torch.nested.nested_tensor(
        list(torch.split(case.q, [s.new for s in case.seqs])), layout=torch.jagged
    ).transpose(1, 2)  # [B, heads, j, d]
    pairs = zip(case.tables, case.seqs, strict=True)
    keys = [case.pool_k[slots_of(t, s.past + s.new).to(case.q.device)] for t, s in pairs]
    k = torch.nested.nested_tensor(keys, layout=torch.jagged).transpose(1, 2)
    mask = padded_plan(case).mask
    try:
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    except Exception as error:  # the message is the result
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "ran"
