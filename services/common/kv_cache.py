"""KV memory in fixed-size blocks: one pool per model, a block table per sequence.

The pool holds, per layer, keys and values for `blocks * block_size` slots; slot
`block * block_size + offset` is one token's entry. A sequence's entries live in the blocks
its table lists, in order, so position p is at slot table[p // block_size] * block_size +
p % block_size. Growing a sequence takes more blocks (nothing is copied); rolling it back is
setting its length; keeping an accepted draft path copies its few entries down.

Only the thread that runs forward passes takes blocks; a sequence's blocks go back to the pool
when it is freed or garbage collected, from any thread (list appends are atomic).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BLOCK_SIZE = 16


class KVPool:
    """Keys and values of every sequence of one model, in blocks.

    keys, values: [layers, slots, kv_heads, head_dim]; slots = blocks * block_size.
    """

    @torch.inference_mode()
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        block_size: int = BLOCK_SIZE,
        blocks: int = 256,
    ):
        if block_size < 1 or blocks < 1:
            raise ValueError(f"block_size ({block_size}) and blocks ({blocks}) must be >= 1")
        self.block_size = block_size
        shape = (layers, blocks * block_size, kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.free_blocks: list[int] = list(range(blocks - 1, -1, -1))  # popped from the end

    @property
    def blocks(self) -> int:
        return self.keys.shape[1] // self.block_size

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]

    def grow_to(self, tokens: int) -> None:
        """Makes room for at least `tokens` entries in all (allocated now, not as they fill)."""
        more = -(-tokens // self.block_size) - self.blocks
        if more > 0:
            self._grow(more)

    def take(self, count: int) -> list[int]:
        """`count` free blocks; the pool grows (doubling) when too few are free."""
        if len(self.free_blocks) < count:
            self._grow(max(self.blocks, count))
        return [self.free_blocks.pop() for _ in range(count)]

    def give_back(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

    @torch.inference_mode()
    def _grow(self, more: int) -> None:
        old = self.blocks
        log.info("KV pool grows", extra={"blocks": old, "new_blocks": old + more})
        for name in ("keys", "values"):
            tensor = getattr(self, name)
            grown = tensor.new_empty(
                (tensor.shape[0], (old + more) * self.block_size, *tensor.shape[2:])
            )
            grown[:, : tensor.shape[1]] = tensor  # only what was there is copied (touched)
            setattr(self, name, grown)
        self.free_blocks[:0] = range(old + more - 1, old - 1, -1)  # the new ones are taken last

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """[end - start] int64 (on the host): the slots of positions start..end-1 of a
        sequence whose block table is `table`."""
        size = self.block_size
        first, last = start // size, (end + size - 1) // size
        blocks = torch.tensor(table[first:last], dtype=torch.long)
        slots = (blocks[:, None] * size + torch.arange(size)).flatten()
        return slots[start - first * size : end - first * size]


class SequenceKV:
    """One sequence's KV entries in a pool: positions 0..length-1 hold valid entries.

    `limit` is the sequence's reservation in tokens (admission's rule); blocks are taken as
    positions are written, never more than the positions need."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table: list[int] = []  # block ids, in position order
        self.length = 0
        self.limit: int | None = None

    @property
    def capacity(self) -> int:
        """Tokens the sequence's blocks hold."""
        return len(self.table) * self.pool.block_size

    def reserve(self, needed: int) -> None:
        """Takes blocks so that `needed` positions fit."""
        missing = -(-needed // self.pool.block_size) - len(self.table)
        if missing > 0:
            self.table.extend(self.pool.take(missing))

    def slots(self, start: int, end: int) -> torch.Tensor:
        """[end - start] slots of positions start..end-1 (host tensor)."""
        return self.pool.slots(self.table, start, end)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def keep(self, start: int, offsets: list[int]) -> None:
        """Keeps entries start+offsets[i] at start+i and drops everything after them.

        Used after tree verification: the accepted path's nodes move next to the prefix."""
        if offsets != list(range(len(offsets))):
            src = self.slots(start, start + max(offsets) + 1)[offsets].to(self.pool.keys.device)
            dst = self.slots(start, start + len(offsets)).to(self.pool.keys.device)
            for tensor in (self.pool.keys, self.pool.values):
                tensor[:, dst] = tensor[:, src]
        self.length = start + len(offsets)

    def free(self) -> None:
        """Gives the blocks back; the sequence holds nothing after this."""
        table, self.table, self.length = self.table, [], 0
        self.pool.give_back(table)

    def __del__(self) -> None:
        if self.table:
            self.pool.give_back(self.table)
