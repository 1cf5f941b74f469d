"""KV memory in fixed-size blocks: one pool per model, a block table per sequence.

The pool holds, per layer, keys and values for `blocks * block_size` slots; slot
`block * block_size + offset` is one token's entry. A sequence's entries live in the blocks
its table lists, in order, so position p is at slot table[p // block_size] * block_size +
p % block_size. Growing a sequence takes more blocks (nothing is copied); rolling it back is
setting its length; keeping an accepted draft path copies its few entries down and gives the
blocks the rest of the tree used back.

Automatic prefix caching: once a block is full of committed entries it is sealed under its
chained prefix hash (prefix.py) and becomes shareable: another sequence whose tokens hash the
same takes it over by reference instead of computing it. Blocks are reference-counted; a sealed
block nobody references stays cached, and the least recently released of those are evicted
first when blocks are taken. A sealed block is never written again.

A pool is either fixed (the verifier's: its size is the KV budget, and running out raises
OutOfBlocks for the caller to handle) or grows by doubling (the drafter's and the tools').
Every method is thread-safe; a sequence garbage collected unfreed gives its blocks back at the
pool's next call.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from ..common import prefix
from ..common.capacity import admission_blocks

log = logging.getLogger(__name__)

BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    """A fixed pool has too few free blocks for what was asked."""


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
        fixed: bool = False,
        model_version: str = "",
    ):
        if block_size < 1 or blocks < 1:
            raise ValueError(f"block_size ({block_size}) and blocks ({blocks}) must be >= 1")
        self.block_size = block_size
        self.fixed = fixed
        self.model_version = model_version
        self.root = prefix.root(model_version)  # the parent hash of every unscoped first block
        shape = (layers, blocks * block_size, kv_heads, head_dim)
        self.keys = head_major(shape, dtype, device)
        self.values = head_major(shape, dtype, device)
        self.free_blocks: list[int] = list(range(blocks - 1, -1, -1))  # popped from the end
        self.refs = [0] * blocks  # sequences holding each block
        self.hash_of: dict[int, int] = {}  # sealed block -> its prefix hash
        self.by_hash: dict[int, int] = {}  # prefix hash -> sealed block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # sealed, unreferenced; LRU first
        self.hits = 0  # blocks handed out from the cache (tokens = hits * block_size)
        self._orphans: list[list[int]] = []  # tables of sequences collected unfreed
        # Entries to move (kept paths), made at the start of the next step (Step.moves) on every
        # rank of a tensor-parallel model; nothing touches KV in between.
        self._moves: list[tuple[np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()

    @property
    def blocks(self) -> int:
        return self.keys.shape[1] // self.block_size

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def available(self) -> int:
        """Blocks that can be taken now: free ones and cached ones nobody references."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.blocks - self.available

    @property
    def cached(self) -> int:
        """Sealed blocks (held or not): the prefix cache."""
        return len(self.hash_of)

    def take(self, count: int) -> list[int]:
        """`count` blocks for one sequence: free ones first, then the least recently used
        cached ones (evicted). A growing pool grows when too few are available; a fixed one
        raises OutOfBlocks and takes none."""
        with self._lock:
            self._make_room(count)
            return self._take(count)

    def reserve(self, needs: list[tuple[SequenceKV, int]]) -> None:
        """Takes blocks so that each sequence holds its number of positions: for all of them
        or (OutOfBlocks, fixed pool) for none, checked and taken at once, so that no other
        thread's take comes in between."""
        with self._lock:
            missing = [kv.missing(needed) for kv, needed in needs]
            self._make_room(sum(missing))
            for (kv, _), count in zip(needs, missing, strict=True):
                kv.table.extend(self._take(count))

    def _make_room(self, count: int) -> None:
        self._collect()
        if self.available < count:
            if self.fixed:
                raise OutOfBlocks(f"{count} KV blocks asked for, {self.available} available")
            self._grow(max(self.blocks, count))

    def _take(self, count: int) -> list[int]:
        taken = []
        for _ in range(count):
            if self.free_blocks:
                block = self.free_blocks.pop()
            else:
                block, _ = self.evictable.popitem(last=False)
                del self.by_hash[self.hash_of.pop(block)]
            self.refs[block] = 1
            taken.append(block)
        return taken

    def release(self, blocks: list[int]) -> None:
        """One reference less on each block; an unreferenced block is free again, or stays
        cached (evictable, most recently used last) if it is sealed. A sequence's blocks are
        released last first, so that a prefix's first blocks, which its later ones need to be
        found, are evicted last."""
        with self._lock:
            self._release(blocks)

    def seal(self, block: int, h: int) -> bool:
        """Caches a full block under its prefix hash; False (and not cached) if another block
        holds that prefix already."""
        with self._lock:
            if h in self.by_hash or block in self.hash_of:
                return False
            self.hash_of[block], self.by_hash[h] = h, block
            return True

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first, each now referenced
        once more by the caller (who gives them back with release)."""
        with self._lock:
            found = []
            for h in hashes:
                block = self.by_hash.get(h)
                if block is None:
                    break
                self.evictable.pop(block, None)
                self.refs[block] += 1
                found.append(block)
            self.hits += len(found)
            return found

    def summary(self, limit: int) -> list[str]:
        """Short hashes (prefix.short) of up to `limit` cached blocks: those in use, then the
        most recently used of the rest."""
        with self._lock:
            held = [h for b, h in self.hash_of.items() if self.refs[b]]
            idle = [self.hash_of[b] for b in reversed(self.evictable)]
            return [prefix.short(h) for h in (held + idle)[:limit]]

    def slots(self, table: list[int], start: int, end: int) -> np.ndarray:
        """[end - start] int64 (on the host): the slots of positions start..end-1 of a
        sequence whose block table is `table`."""
        size = self.block_size
        first, last = start // size, (end + size - 1) // size
        blocks = np.asarray(table[first:last], dtype=np.int64)
        slots = (blocks[:, None] * size + np.arange(size)).ravel()
        return slots[start - first * size : end - first * size]

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies the entries at slots `src` to slots `dst` ([m] host arrays), every layer, at
        the start of the next forward pass (with every other move since the last pass, in one
        copy: see apply_moves). Until then nothing reads or writes the pool's entries."""
        with self._lock:
            self._moves.append((src, dst))

    def take_moves(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The moves asked for since the last call, in order."""
        with self._lock:
            moves, self._moves = self._moves, []
        return moves

    def put_back(self, moves: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Moves taken for a pass that never ran: they come first in the next one."""
        with self._lock:
            self._moves[:0] = moves

    @torch.inference_mode()
    def apply_moves(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Makes moves (src, dst [m] slots on the pool's device, several sequences' moves one
        after another): every source entry is read before any is written, so a move's
        destination may be another's source. No two moves share a destination."""
        for tensor in (self.keys, self.values):
            tensor[:, dst] = tensor[:, src]

    def orphaned(self, table: list[int]) -> None:
        """A sequence was collected without being freed: its blocks go back at the next call
        (not now: the collector may run inside one of this pool's calls)."""
        self._orphans.append(table)  # (list appends are atomic)

    def _collect(self) -> None:
        while self._orphans:
            self._release(self._orphans.pop())

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)

    @torch.inference_mode()
    def _grow(self, more: int) -> None:
        old = self.blocks
        log.info("KV pool grows", extra={"blocks": old, "new_blocks": old + more})
        for name in ("keys", "values"):
            tensor = getattr(self, name)
            shape = (tensor.shape[0], (old + more) * self.block_size, *tensor.shape[2:])
            grown = head_major(shape, tensor.dtype, tensor.device)
            grown[:, : tensor.shape[1]] = tensor  # only what was there is copied (touched)
            setattr(self, name, grown)
        self.refs.extend([0] * more)
        self.free_blocks[:0] = range(old + more - 1, old - 1, -1)  # the new ones are taken last


def head_major(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """An empty [layers, slots, kv_heads, head_dim] pool tensor stored head by head: each
    layer's entries of one KV head lie one after another. Attention reads one head's entries
    of a sequence at a time (one thread each on a CPU); interleaved with the other heads'
    (slot-major), each thread read half of every 1 KiB entry, and one head's pass over 2,000
    entries took 1.5x as long (the default target's shapes, the engine's CPU kernel)."""
    layers, slots, kv_heads, head_dim = shape
    stored = torch.empty((layers, kv_heads, slots, head_dim), dtype=dtype, device=device)
    return stored.transpose(1, 2)


class SequenceKV:
    """One sequence's KV entries in a pool: positions 0..length-1 hold valid entries.

    The first len(hashes) blocks of the table are sealed (cached, perhaps shared): their
    entries are committed and never rewritten. Blocks are taken as positions are written."""

    def __init__(self, pool: KVPool, scope: str = ""):
        self.pool = pool
        # The parent hash of its first block: blocks are shared only within one scope.
        self.root = prefix.root(pool.model_version, scope) if scope else pool.root
        self.table: list[int] = []  # block ids, in position order
        self.hashes: list[int] = []  # prefix hashes of the sealed blocks table[:len(hashes)]
        self.length = 0

    @classmethod
    def start(
        cls,
        pool: KVPool,
        token_ids: list[int],
        *,
        reuse: bool,
        keep_free: int = 0,
        scope: str = "",
    ) -> SequenceKV:
        """A sequence holding the blocks of `token_ids` and of the token after them: the cached
        blocks of their longest cached prefix in `scope` by reference (when `reuse`; its
        length is past them), new ones for the rest. Raises OutOfBlocks, holding nothing,
        unless `keep_free` blocks are left over (capacity.admission_blocks: the rule admission
        and resumption share)."""
        kv = cls(pool, scope)
        if reuse:
            kv.reuse(token_ids)
        need = admission_blocks(len(token_ids), len(kv.table), pool.block_size)
        try:
            if need + keep_free > pool.available:
                free = max(0, pool.available - keep_free)
                raise OutOfBlocks(
                    f"needs {need} KV blocks of {pool.block_size} tokens, {free} are free"
                )
            kv.reserve(len(token_ids) + 1)
        except OutOfBlocks:
            kv.free()
            raise
        return kv

    @property
    def capacity(self) -> int:
        """Tokens the sequence's blocks hold."""
        return len(self.table) * self.pool.block_size

    def missing(self, needed: int) -> int:
        """Blocks to take so that `needed` positions fit."""
        return max(0, -(-needed // self.pool.block_size) - len(self.table))

    def reserve(self, needed: int) -> None:
        """Takes blocks so that `needed` positions fit (a fixed pool may raise OutOfBlocks)."""
        if missing := self.missing(needed):
            self.table.extend(self.pool.take(missing))

    def reuse(self, token_ids: list[int]) -> int:
        """Starts an empty sequence with the cached blocks of the longest cached prefix of
        `token_ids` (all but the last token: that one must be computed, for its logits).
        Returns how many tokens it reused."""
        if self.table:
            raise ValueError("reuse starts an empty sequence")
        size = self.pool.block_size
        hashes = prefix.block_hashes(token_ids[: len(token_ids) - 1], size, self.root)
        self.table = self.pool.lookup(hashes)
        self.hashes = hashes[: len(self.table)]
        self.length = len(self.table) * size
        return self.length

    def sealable(self, tokens: int) -> bool:
        """Whether a block has filled with committed entries of `tokens` known tokens since
        the last `seal`."""
        return min(self.length, tokens) // self.pool.block_size > len(self.hashes)

    def seal(self, token_ids: list[int]) -> None:
        """Caches the blocks that are full of committed entries; `token_ids` are the tokens of
        positions 0.. (past the last of them nothing is sealed: a sequence that ended inside
        an accepted draft path holds entries of tokens it never emitted)."""
        size = self.pool.block_size
        parent = self.hashes[-1] if self.hashes else self.root
        for index in range(len(self.hashes), min(self.length, len(token_ids)) // size):
            parent = prefix.chain(parent, token_ids[index * size : (index + 1) * size])
            self.pool.seal(self.table[index], parent)
            self.hashes.append(parent)

    def slots(self, start: int, end: int) -> np.ndarray:
        """[end - start] slots of positions start..end-1 (host array)."""
        return self.pool.slots(self.table, start, end)

    def truncate(self, length: int) -> None:
        """Forgets the entries from `length` on. Sealed blocks are never rewritten: one that
        the cut reaches is dropped from the sequence (it stays cached), and the sequence is cut
        to its start (those entries are computed again, into a block of its own)."""
        self.length = min(self.length, length)
        keep = self.length // self.pool.block_size
        if keep < len(self.hashes):
            dropped, self.table = self.table[keep:], self.table[:keep]
            self.hashes = self.hashes[:keep]
            self.length = keep * self.pool.block_size
            self.pool.release(dropped[::-1])

    def trim(self) -> None:
        """Gives back the blocks past the last entry (a draft tree's scratch)."""
        keep = -(-self.length // self.pool.block_size)
        if len(self.table) > keep:
            spare, self.table = self.table[keep:], self.table[:keep]
            self.pool.release(spare[::-1])

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keeps entries start+offsets[i] at start+i, drops everything after them and gives
        back the blocks only they used (the entries move at the next pass: KVPool.move).

        Used after tree verification: the accepted path's nodes move next to the prefix."""
        if offsets != list(range(len(offsets))):
            src = self.slots(start, start + max(offsets) + 1)[offsets]
            self.pool.move(src, self.slots(start, start + len(offsets)))
        self.length = start + len(offsets)
        self.trim()

    def free(self) -> None:
        """Gives the blocks back (sealed ones stay cached); the sequence holds nothing after."""
        table, self.table, self.hashes, self.length = self.table, [], [], 0
        self.pool.release(table[::-1])

    def __del__(self) -> None:
        if self.table:
            self.pool.orphaned(self.table)
