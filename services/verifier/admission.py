"""Admission on a verifier: batch slots per class, the KV token budget, and the prefix cache.

Every sequence reserves, when it is admitted, the most KV entries it can ever hold
(`capacity.kv_need`: min(prompt + max_tokens, max_seq_len) tokens). Its buffer never grows past
that reservation, so the reservations, plus the buffers kept by the prefix cache, bound the KV
memory: admission never overcommits the budget.

The prefix cache keeps the KV buffer of a finished session turn under its session id, in budget
that no running sequence reserved; admissions evict the least recently stored entries when they
need the room. The next turn of that session takes the buffer over and computes only the part of
its prompt that differs. All methods are thread-safe (RPC threads admit, the loop releases).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.flat_model import FlatModel, SequenceKV


@dataclass
class CachedPrefix:
    """A finished turn's KV: kv holds the entries of token_ids."""

    token_ids: list[int]
    kv: SequenceKV


@dataclass
class Grant:
    """An admitted sequence's reservation; `prefix` is its session's cached KV, if any."""

    tokens: int
    priority: str
    prefix: CachedPrefix | None = None


class Refused(Exception):
    """The sequence does not fit now; the message says why."""


class Admission:
    def __init__(self, kv_budget: int, batch_size: int, interactive_reserved_slots: int):
        self.kv_budget = kv_budget
        self.batch_size = batch_size
        self.batch_slots = batch_size - interactive_reserved_slots
        self._grants: dict[str, Grant] = {}
        self._cache: OrderedDict[str, CachedPrefix] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    # --- what the registry and Status report ------------------------------------------------
    def load(self) -> dict[str, int]:
        with self._lock:
            return {
                "running": len(self._grants),
                "batch_running": self._batch_running(),
                "kv_reserved": self._reserved(),
                "kv_cached": self._cached(),
            }

    def holds(self, rid: str) -> bool:
        with self._lock:
            return rid in self._grants

    # --- admission --------------------------------------------------------------------------
    def admit(self, rid: str, priority: str, tokens: int, session_id: str = "") -> Grant | None:
        """Reserves a slot and `tokens` KV entries, evicting cached prefixes if needed; takes
        the session's cached prefix. None if `rid` holds a reservation already (an admission
        of it is done or under way). Raises Refused if it does not fit now."""
        with self._lock:
            if rid in self._grants:
                return None
            if len(self._grants) >= self.batch_size:
                raise Refused("the batch is full")
            if priority == "batch" and self._batch_running() >= self.batch_slots:
                raise Refused("the batch-class slots are full")
            prefix = self._cache.pop(session_id, None) if session_id else None
            if prefix is not None:
                tokens = max(tokens, prefix.kv.capacity)  # its buffer is the sequence's now
            free = self.kv_budget - self._reserved()
            if tokens > free:
                if prefix is not None:
                    self._cache[session_id] = prefix
                raise Refused(f"needs {tokens} KV tokens, {free} are free")
            while self._cached() > free - tokens:
                self._cache.popitem(last=False)
            grant = Grant(tokens, priority, prefix)
            self._grants[rid] = grant
            return grant

    def release(self, rid: str, session_id: str = "", prefix: CachedPrefix | None = None) -> bool:
        """Frees a sequence's reservation; keeps `prefix` (which its caller no longer uses) for
        its session if it fits in budget nobody reserved. Returns True if it was kept."""
        with self._lock:
            self._grants.pop(rid, None)
            if prefix is None or not session_id:
                return False
            self._cache.pop(session_id, None)
            size = prefix.kv.capacity
            free = self.kv_budget - self._reserved()
            if size > free:
                return False
            while self._cached() + size > free:
                self._cache.popitem(last=False)
            self._cache[session_id] = prefix
            return True

    def _reserved(self) -> int:
        return sum(g.tokens for g in self._grants.values())

    def _cached(self) -> int:
        return sum(p.kv.capacity for p in self._cache.values())

    def _batch_running(self) -> int:
        return sum(g.priority == "batch" for g in self._grants.values())


def bytes_per_token(model: FlatModel) -> int:
    """KV bytes of one token: keys and values of every layer."""
    item = torch.empty((), dtype=model.dtype).element_size()
    return 2 * len(model.layers) * model.kv_heads * model.head_dim * item


def free_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory, or available RAM for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory; set kv_budget_tokens")


def kv_budget(configured: int, fraction: float, model: FlatModel) -> int:
    """The configured budget, or `fraction` of the memory free now, in tokens."""
    if configured:
        return configured
    return int(free_memory_bytes(model.device) * fraction) // bytes_per_token(model)
