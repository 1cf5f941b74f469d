"""The layout of one forward pass: every new token of every sequence in one flat batch.

A step's new tokens (prompt chunks, decode tokens, draft-tree nodes) are T rows; the linear
layers see them as one [T, hidden] matrix. Attention sees them in at most two groups, one call
each: the sequences with few new tokens (decode tokens, draft trees) and those with many
(prompt chunks), so that a 512-token chunk does not pad every tree in the step to its length.
Within a group, sequences are padded to the group's longest new-token count (Nmax) against
their KV padded to its longest context (Lmax), with one boolean mask for the group. The mask
is built on the device from a few numbers per sequence (where its new tokens start, how many
there are): causal by default; a draft tree's small [new, new] ancestry block is written into
it in one scatter.

The forms a step takes, in order:
- Segment (the caller's, host): one sequence's new tokens, positions and mask.
- Placed (host): a segment with KV room reserved, and the pool slots of its entries. A
  tensor-parallel rank builds the same step from what rank 0 placed (tensor_parallel.py).
- Step (host): the placed segments, and the KV moves of paths kept since the last step.
- Batch (device): every index the forward pass reads, laid out on the host in numpy (no
  torch op per sequence) as one int64 buffer that crosses to the device in one non-blocking
  copy (`to_device`); the fields are views of it. Computed once per step, shared by every
  layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .kv_cache import SequenceKV

# Sequences with at most this many new tokens share one attention call, the rest another
# (docs/design/engine.md, "Attention kernel": one call for a mixed step pads 3.7-5.9x the work).
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
    mask: np.ndarray | None = None  # [n, kv.length + n - mask_from] bool; None: causal
    mask_from: int | None = None  # None: kv.length (the new tokens see every cached entry)
    logits_from: int = -1  # rows >= this get logits (-1: only the last row)


@dataclass
class Placed:
    """One segment laid out on the host: its new tokens and the pool slots of its entries."""

    token_ids: list[int]  # [n]
    positions: list[int]  # [n]
    past: int  # entries before the new tokens
    slots: np.ndarray  # [past + n] int64 slot of every entry; the last n are written now
    mask: np.ndarray | None  # as Segment.mask
    mask_from: int | None  # as Segment.mask_from
    logits_from: int  # first row that gets logits


@dataclass
class Step:
    """The work of one forward pass, on the host: what rank 0 plans and every rank runs."""

    placed: list[Placed]
    moves: list[tuple[np.ndarray, np.ndarray]]  # ([m] from, [m] to) slots, in order, first


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


def to_device(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on `device` in one non-blocking copy: from pinned memory on CUDA (torch's
    caching host allocator reuses a pinned block only once the copies out of it are done); on
    the CPU the array itself."""
    host = (
        array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    )
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Packer:
    """Host int64 arrays laid end to end, to cross to the device as one buffer; `add` returns
    a handle that `view` turns into the array's device tensor."""

    def __init__(self):
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add(self, values) -> tuple[int, tuple[int, ...]]:
        array = np.asarray(values, dtype=np.int64)
        self.parts.append(array.ravel())
        at, self.size = self.size, self.size + array.size
        return at, array.shape

    def send(self, device: torch.device) -> torch.Tensor:
        flat = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64)
        return to_device(flat, device)

    @staticmethod
    def view(buffer: torch.Tensor, handle: tuple[int, tuple[int, ...]]) -> torch.Tensor:
        at, shape = handle
        return buffer[at : at + int(np.prod(shape, dtype=np.int64))].view(shape)


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

    def slots(self, device: torch.device) -> torch.Tensor:
        """kv_slots; for one sequence's contiguous entries (kv_range), made on first use."""
        if self.kv_slots is None:
            first, length = self.kv_range
            self.kv_slots = torch.arange(first, first + length, device=device)[None]
        return self.kv_slots


@dataclass
class Batch:
    """Index tensors of one step, on the model's device (views of one buffer)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    max_position: int  # the largest of them (host)
    write_slots: torch.Tensor  # [T] pool slot each new token's K/V goes to
    groups: list[AttentionGroup]  # one or two; every row of the batch is in exactly one
    logit_rows: torch.Tensor  # [R] rows that get logits
    logit_counts: list[int]  # [B] how many of them each sequence has
    moves: tuple[torch.Tensor, torch.Tensor] | None  # ([m] from, [m] to) KV slots to move first

    @classmethod
    def build(cls, segments: list[Segment], device: torch.device) -> Batch:
        """Reserves KV room for the new tokens and lays the step out (kv.length as it was)."""
        return cls.of(Step(place(segments), []), device)

    @classmethod
    def of(cls, step: Step, device: torch.device) -> Batch:
        """The step's index tensors on `device`, from its placed segments and moves."""
        placed = step.placed
        news = [len(p.token_ids) for p in placed]
        starts = np.cumsum([0, *news[:-1]]).tolist()
        packer = Packer()
        ids = packer.add([t for p in placed for t in p.token_ids])
        every_position = [t for p in placed for t in p.positions]
        positions = packer.add(every_position)
        writes = packer.add(np.concatenate([p.slots[p.past :] for p in placed]))
        rows = packer.add(
            [
                s + r
                for p, s, n in zip(placed, starts, news, strict=True)
                for r in range(p.logits_from, n)
            ]
        )
        moves = None
        if step.moves:
            moves = (
                packer.add(np.concatenate([src for src, _ in step.moves])),
                packer.add(np.concatenate([dst for _, dst in step.moves])),
            )
        short = [i for i, n in enumerate(news) if n <= SHORT_TOKENS]
        long = [i for i, n in enumerate(news) if n > SHORT_TOKENS]
        members = [short, long] if short and long else [list(range(len(placed)))]
        layouts = [
            GroupLayout.of(
                [placed[i] for i in group],
                None if len(members) == 1 else [starts[i] for i in group],
                packer,
            )
            for group in members
        ]
        buffer = packer.send(device)
        view = partial(Packer.view, buffer)
        return cls(
            input_ids=view(ids),
            positions=view(positions),
            max_position=max(every_position, default=0),
            write_slots=view(writes),
            groups=[layout.on(buffer, device) for layout in layouts],
            logit_rows=view(rows),
            logit_counts=[n - p.logits_from for p, n in zip(placed, news, strict=True)],
            moves=None if moves is None else (view(moves[0]), view(moves[1])),
        )

    @staticmethod
    def advance(segments: list[Segment]) -> None:
        """The pass is done: each sequence's KV holds its new tokens."""
        for seg in segments:
            seg.kv.length += len(seg.token_ids)


Handle = tuple[int, tuple[int, ...]]


@dataclass
class GroupLayout:
    """An attention group laid out on the host: handles into the step's buffer."""

    shape: tuple[int, int, int]  # (B, Nmax, Lmax)
    rows: Handle | None
    kv_slots: Handle | None
    kv_range: tuple[int, int] | None
    query_index: Handle | None
    output_index: Handle | None
    mask: Handle | None  # [2, B]: pasts, news (None: no mask)
    explicit: tuple[Handle, Handle] | None  # ([e] flat mask index, [e] 0/1): the segments' own

    @classmethod
    def of(cls, placed: list[Placed], starts: list[int] | None, packer: Packer) -> GroupLayout:
        """The padded layout of `placed`; `starts` are the first rows of their tokens in the
        flat batch (None: the group is the whole batch)."""
        news = [len(p.token_ids) for p in placed]
        b, n_max, l_max = len(placed), max(news), max(len(p.slots) for p in placed)
        kv_slots, kv_range, query_index, output_index, rows = None, None, None, None, None
        first = placed[0].slots
        if b == 1 and (len(first) < 2 or (np.diff(first) == 1).all()):
            kv_range = (int(first[0]), l_max)
        else:
            padded = np.zeros((b, l_max), dtype=np.int64)
            for i, p in enumerate(placed):
                padded[i, : len(p.slots)] = p.slots
            kv_slots = packer.add(padded)
        if b > 1:
            offsets = np.cumsum([0, *news[:-1]])
            index = np.arange(n_max)[None, :]  # [1, Nmax]
            live = index < np.asarray(news)[:, None]  # [B, Nmax]
            query_index = packer.add(np.where(live, offsets[:, None] + index, 0).ravel())
            output_index = packer.add((np.arange(b)[:, None] * n_max + index)[live])
        if starts is not None:
            rows = packer.add(
                np.concatenate([np.arange(s, s + n) for s, n in zip(starts, news, strict=True)])
            )
        explicit = [i for i, p in enumerate(placed) if p.mask is not None]
        mask = explicit_mask = None
        if not (b == 1 and n_max == 1 and not explicit):
            mask = packer.add([[p.past for p in placed], news])
        if explicit:
            index, values = [], []
            for i in explicit:
                p = placed[i]
                start = p.past if p.mask_from is None else p.mask_from
                own = np.asarray(p.mask, dtype=np.int64)  # [n, width]
                r, c = np.indices(own.shape)
                index.append((i * n_max + r.ravel()) * l_max + start + c.ravel())
                values.append(own.ravel())
            explicit_mask = (packer.add(np.concatenate(index)), packer.add(np.concatenate(values)))
        return cls(
            (b, n_max, l_max),
            rows,
            kv_slots,
            kv_range,
            query_index,
            output_index,
            mask,
            explicit_mask,
        )

    def on(self, buffer: torch.Tensor, device: torch.device) -> AttentionGroup:
        """The group's tensors: views of the step's buffer on `device`, and its mask."""

        def view(handle: Handle | None) -> torch.Tensor | None:
            return None if handle is None else Packer.view(buffer, handle)

        return AttentionGroup(
            rows=view(self.rows),
            kv_slots=view(self.kv_slots),
            kv_range=self.kv_range,
            query_index=view(self.query_index),
            output_index=view(self.output_index),
            mask=None if self.mask is None else self._mask(buffer, device),
            shape=self.shape,
        )

    def _mask(self, buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[B, 1, Nmax, Lmax] bool: entry j is visible to new token i of sequence b. Causal
        from the sequence's past length; a segment's own mask replaces its part from
        mask_from on (one scatter for the group). Padded query rows see entry 0 only (a row
        that sees nothing would be NaN); they are dropped after attention."""
        _, n_max, l_max = self.shape
        sizes = Packer.view(buffer, self.mask)  # [2, B]
        past, new = sizes[0][:, None, None], sizes[1][:, None, None]  # [B, 1, 1]
        row = torch.arange(n_max, device=device)[None, :, None]  # [1, Nmax, 1]
        col = torch.arange(l_max, device=device)[None, None, :]  # [1, 1, Lmax]
        padding = row >= new  # [B, Nmax, 1]
        mask = ((col <= past + row) & ~padding) | (padding & (col == 0))  # [B, Nmax, Lmax]
        if self.explicit is not None:
            index, values = (Packer.view(buffer, h) for h in self.explicit)
            mask.view(-1)[index] = values.bool()
        return mask[:, None]
