"""The layout of one forward pass: every new token of every sequence in one flat batch.

A step's new tokens (prompt chunks, decode tokens, draft-tree nodes) are T rows; the linear
layers see them as one [T, hidden] matrix. Attention sees them in at most two groups, one call
each: the sequences with few new tokens (decode tokens, draft trees) and those with many
(prompt chunks), so that a 512-token chunk does not pad every tree in the step to its length.
Within a group, sequences are padded to the group's longest new-token count (Nmax) against
their KV padded to its longest context (Lmax), with one boolean mask for the group. The mask
is built on the device from a few numbers per sequence (where its new tokens start, how many
there are): causal by default; only a draft tree's small [new, new] ancestry block is sent
from the host.

Everything here is computed once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import SequenceKV

# Sequences with at most this many new tokens share one attention call, the rest another
# (docs/architecture.md, "Attention kernel": one call for a mixed step pads 3.7-5.9x the work).
SHORT_TOKENS = 64


@dataclass
class Segment:
    """New tokens of one sequence for one forward pass.

    The tokens are written to kv at positions kv.length.., and kv.length grows by their count.
    Every new token sees the sequence's entries before `mask_from`; from there on, `mask`
    says which of the entries (cached ones, then the new tokens) each new token sees.
    """

    kv: SequenceKV
    token_ids: list[int]  # [n]
    positions: list[int] | None = None  # [n] rotary positions; None: kv.length + 0..n-1
    mask: torch.Tensor | None = None  # [n, kv.length + n - mask_from] bool; None: causal
    mask_from: int | None = None  # None: kv.length (the new tokens see every cached entry)
    logits_from: int = -1  # rows >= this get logits (-1: only the last row)


@dataclass
class Placed:
    """One segment laid out on the host: its new tokens and the pool slots of its entries.
    A step is built from these alone, so every rank of a tensor-parallel model builds the same
    step from what rank 0 placed (tensor_parallel.py)."""

    token_ids: list[int]  # [n]
    positions: list[int]  # [n]
    past: int  # entries before the new tokens
    slots: torch.Tensor  # [past + n] int64 slot of every entry; the last n are written now
    mask: torch.Tensor | None  # as Segment.mask
    mask_from: int | None  # as Segment.mask_from
    logits_from: int  # first row that gets logits


@dataclass
class Step:
    """The work of one forward pass, on the host: what rank 0 plans and every rank runs."""

    placed: list[Placed]
    moves: list[tuple[torch.Tensor, torch.Tensor]]  # ([m] from, [m] to) slots, in order, first


def place(segments: list[Segment]) -> list[Placed]:
    """Reserves KV room for each segment's new tokens and lays it out. kv.length is left as it
    was: the caller advances it once the pass is done (Batch.advance)."""
    placed = []
    for seg in segments:
        n, past = len(seg.token_ids), seg.kv.length
        if n == 0:
            raise ValueError("a segment has no tokens")
        seg.kv.reserve(past + n)
        placed.append(
            Placed(
                token_ids=list(seg.token_ids),
                positions=list(seg.positions or range(past, past + n)),
                past=past,
                slots=seg.kv.slots(0, past + n),
                mask=seg.mask,
                mask_from=seg.mask_from,
                logits_from=n - 1 if seg.logits_from < 0 else seg.logits_from,
            )
        )
    return placed


@dataclass
class AttentionGroup:
    """Sequences of a step that one attention call covers, padded together."""

    rows: torch.Tensor | None  # [t] rows of the flat batch that are this group's (None: all)
    kv_slots: torch.Tensor | None  # [B, Lmax] pool slot of each sequence's entries (0: padding)
    kv_range: tuple[int, int] | None  # (first slot, Lmax) when B == 1 and its slots are contiguous
    query_index: torch.Tensor | None  # [B * Nmax] row (of the group's) of each padded query
    output_index: torch.Tensor | None  # [t] padded row of each new token (None: B == 1)
    mask: torch.Tensor | None  # [B, 1, Nmax, Lmax] bool; None: every token sees every entry
    shape: tuple[int, int, int]  # (B, Nmax, Lmax)


@dataclass
class Batch:
    """Index tensors of one step, on the model's device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] pool slot each new token's K/V goes to
    groups: list[AttentionGroup]  # one or two; every row of the batch is in exactly one
    logit_rows: torch.Tensor  # [R] rows that get logits
    logit_counts: list[int]  # [B] how many of them each sequence has

    @classmethod
    def build(cls, segments: list[Segment], device: torch.device) -> Batch:
        """Reserves KV room for the new tokens and lays the step out (kv.length as it was)."""
        return cls.of(place(segments), device)

    @classmethod
    def of(cls, placed: list[Placed], device: torch.device) -> Batch:
        """The step's index tensors on `device`, from its placed segments."""
        ids, positions, writes, rows, counts, starts = [], [], [], [], [], []
        start = 0
        for p in placed:
            n = len(p.token_ids)
            ids.extend(p.token_ids)
            positions.extend(p.positions)
            writes.append(p.slots[p.past :])
            rows.append(torch.arange(start + p.logits_from, start + n))
            counts.append(n - p.logits_from)
            starts.append(start)
            start += n
        short = [i for i, p in enumerate(placed) if len(p.token_ids) <= SHORT_TOKENS]
        long = [i for i, p in enumerate(placed) if len(p.token_ids) > SHORT_TOKENS]
        members = [short, long] if short and long else [list(range(len(placed)))]
        groups = [
            attention_group(
                [placed[i] for i in group],
                None if len(members) == 1 else [starts[i] for i in group],
                device,
            )
            for group in members
        ]
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.cat(writes).to(device),
            groups=groups,
            logit_rows=torch.cat(rows).to(device),
            logit_counts=counts,
        )

    @staticmethod
    def advance(segments: list[Segment]) -> None:
        """The pass is done: each sequence's KV holds its new tokens."""
        for seg in segments:
            seg.kv.length += len(seg.token_ids)


def attention_group(placed: list[Placed], starts: list[int] | None, device) -> AttentionGroup:
    """The padded layout of `placed`; `starts` are the first rows of their tokens in the flat
    batch (None: the group is the whole batch)."""
    news = [len(p.token_ids) for p in placed]
    reads = [p.slots for p in placed]
    b, n_max, l_max = len(placed), max(news), max(len(r) for r in reads)
    kv_slots, kv_range, query_index, output_index = None, None, None, None
    if b == 1 and bool((reads[0][1:] - reads[0][:-1] == 1).all()):
        kv_range = (int(reads[0][0]), l_max)
    else:
        kv_slots = torch.zeros(b, l_max, dtype=torch.long)
        for i, slots in enumerate(reads):
            kv_slots[i, : len(slots)] = slots
        kv_slots = kv_slots.to(device)
    if b > 1:
        query_index = torch.zeros(b, n_max, dtype=torch.long)
        offset = 0
        for i, n in enumerate(news):
            query_index[i, :n] = torch.arange(offset, offset + n)
            offset += n
        query_index = query_index.flatten().to(device)
        output_index = torch.cat([i * n_max + torch.arange(n) for i, n in enumerate(news)])
        output_index = output_index.to(device)
    rows = None
    if starts is not None:
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news, strict=True)])
        rows = rows.to(device)
    return AttentionGroup(
        rows=rows,
        kv_slots=kv_slots,
        kv_range=kv_range,
        query_index=query_index,
        output_index=output_index,
        mask=build_mask(placed, news, n_max, l_max, device),
        shape=(b, n_max, l_max),
    )


def build_mask(
    placed: list[Placed], news: list[int], n_max: int, l_max: int, device
) -> torch.Tensor | None:
    """[B, 1, Nmax, Lmax] bool: entry j is visible to new token i of sequence b. Causal from
    the sequence's past length, built by comparing index ranges on the device; a segment's own
    mask replaces its part from mask_from on. Padded query rows see entry 0 only (a row that
    sees nothing would be NaN); they are dropped after attention. None when every token sees
    every entry (one sequence decoding one token)."""
    explicit = [i for i, p in enumerate(placed) if p.mask is not None]
    if len(placed) == 1 and n_max == 1 and not explicit:
        return None
    pasts = [p.past for p in placed]
    past = torch.tensor(pasts, device=device)[:, None, None]  # [B, 1, 1]
    new = torch.tensor(news, device=device)[:, None, None]
    row = torch.arange(n_max, device=device)[None, :, None]  # [1, Nmax, 1]
    col = torch.arange(l_max, device=device)[None, None, :]  # [1, 1, Lmax]
    mask = (col <= past + row) & (row < new)  # [B, Nmax, Lmax]
    mask[:, :, 0] |= (row < new).logical_not()[:, :, 0]
    if explicit:  # the segments' own masks cross to the device in one copy
        starts = [p.past if p.mask_from is None else p.mask_from for p in placed]
        widths = [placed[i].past + news[i] - starts[i] for i in explicit]
        host = torch.zeros(len(explicit), n_max, max(widths), dtype=torch.bool)
        for e, i in enumerate(explicit):
            host[e, : news[i], : widths[e]] = placed[i].mask
        own = host.to(device)
        for e, i in enumerate(explicit):
            mask[i, : news[i], starts[i] : starts[i] + widths[e]] = own[e, : news[i], : widths[e]]
    return mask[:, None]
