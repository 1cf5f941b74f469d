"""Admission on a verifier: batch slots per class, and the KV blocks a sequence starts with.

A sequence is admitted when the blocks of its tokens (its prompt, or prompt and output for a
request taken over) are free, less those cached blocks with the same prefix supply
(`capacity.admission_blocks`). It takes them at once, so its prefill never waits for room,
and takes more one at a time as it generates. Admission keeps `watermark` blocks free for that
growth while other sequences run. When blocks still run out mid-generation the engine preempts
(engine.py, "Preemption"); while preempted sequences wait to resume, no new one is admitted, so
they come back first.

Nothing is reserved for the worst case: a long max_tokens costs nothing until it is generated.
All methods are thread-safe (RPC threads admit, the loop releases).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.flat_model import FlatModel, OutOfBlocks, SequenceKV
from ..engine.kv_cache import KVPool


@dataclass
class Grant:
    """An admitted sequence's start: `kv` holds blocks for its tokens, the first
    `cached_tokens` of them taken over from the prefix cache."""

    kv: SequenceKV
    priority: str
    cached_tokens: int = 0


class Refused(Exception):
    """The sequence does not fit now; the message says why."""


class Admission:
    def __init__(
        self,
        pool: KVPool,
        batch_size: int,
        interactive_reserved_slots: int,
        *,
        watermark_blocks: int = 0,
        prefix_cache: bool = True,
    ):
        self.pool = pool
        self.batch_size = batch_size
        self.batch_slots = batch_size - interactive_reserved_slots
        self.watermark_blocks = watermark_blocks
        self.prefix_cache = prefix_cache
        self.resuming = 0  # preempted sequences waiting for room (set by the engine's loop)
        self._grants: dict[str, Grant] = {}
        self._lock = threading.Lock()

    @property
    def kv_budget(self) -> int:
        """The pool's size in tokens (whole blocks)."""
        return self.pool.tokens

    # --- what the registry and Status report ------------------------------------------------
    def load(self) -> dict[str, int]:
        """Slots taken, and the pool in blocks: held by sequences, cached (sealed), and free
        for admission (`_free`)."""
        with self._lock:
            return {
                "running": len(self._grants),
                "batch_running": self._batch_running(),
                "block_size": self.pool.block_size,
                "kv_blocks": self.pool.blocks,
                "kv_used": self.pool.used,
                "kv_cached": self.pool.cached,
                "kv_free": self._free(),
            }

    def holds(self, rid: str) -> bool:
        with self._lock:
            return rid in self._grants

    # --- admission --------------------------------------------------------------------------
    def admit(self, rid: str, priority: str, token_ids: list[int], scope: str = "") -> Grant | None:
        """Takes a slot and the blocks of `token_ids` (cached ones of `scope` by reference:
        prefix.scope_of). None if `rid`
        holds a grant already (an admission of it is done or under way). Raises Refused if it
        does not fit now."""
        with self._lock:
            if rid in self._grants:
                return None
            if len(self._grants) >= self.batch_size:
                raise Refused("the batch is full")
            if priority == "batch" and self._batch_running() >= self.batch_slots:
                raise Refused("the batch-class slots are full")
            if self.resuming:
                raise Refused(f"{self.resuming} preempted sequences wait for KV room first")
            keep_free = self.watermark_blocks if self._grants else 0
            try:
                kv = SequenceKV.start(
                    self.pool, token_ids, reuse=self.prefix_cache, keep_free=keep_free, scope=scope
                )
            except OutOfBlocks as e:
                raise Refused(str(e)) from e
            grant = Grant(kv, priority, kv.length)
            self._grants[rid] = grant
            return grant

    def release(self, rid: str) -> None:
        """Frees a sequence's slot (its blocks go back with its KV: SequenceKV.free)."""
        with self._lock:
            self._grants.pop(rid, None)

    def _free(self) -> int:
        """Blocks a new sequence may take now: none while preempted ones wait to resume; the
        available ones less the watermark while any sequence runs."""
        if self.resuming:
            return 0
        return max(0, self.pool.available - (self.watermark_blocks if self._grants else 0))

    def _batch_running(self) -> int:
        return sum(g.priority == "batch" for g in self._grants.values())


def bytes_per_token(model: FlatModel) -> int:
    """KV bytes of one token: keys and values of every layer."""
    item = torch.empty((), dtype=model.dtype).element_size()
    return 2 * len(model.layers) * model.kv_heads * model.head_dim * item


def free_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory; for the CPU, available RAM, or what the container's memory
    limit leaves if that is less (a pod on a big node must not size itself by the node)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            left = cgroup_free_bytes()
            return available if left is None else min(available, left)
    raise RuntimeError("cannot read available memory; set kv_budget_tokens")


CGROUP_FILES = (  # (limit, usage, stat, reclaimable page cache in stat): cgroup v2, then v1
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_inactive_file",
    ),
)


def cgroup_free_bytes(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's cgroup may still take before its memory limit: the limit less its
    working set (usage less reclaimable page cache, as the kubelet counts it); None with no
    limit or no cgroup."""
    for limit_file, usage_file, stat_file, inactive_key in CGROUP_FILES:
        try:
            text = (root / limit_file).read_text().strip()
            limit = None if text == "max" else int(text)
            usage = int((root / usage_file).read_text())
            stat = (root / stat_file).read_text().split("\n")
        except (OSError, ValueError):
            continue
        if limit is None or limit >= 1 << 60:  # (v1 writes "no limit" as a huge number)
            return None
        fields = dict(line.split() for line in stat if line.count(" ") == 1)
        working_set = usage - int(fields.get(inactive_key, 0))
        return max(0, limit - working_set)
    return None


def kv_budget(configured: int, fraction: float, model: FlatModel) -> int:
    """The configured budget, or `fraction` of the memory free now, in tokens. The ranks of a
    tensor-parallel model on the CPU share its memory: each holds 1/N of a token's entries."""
    if configured:
        return configured
    shared = model.shards.world if model.shards and model.device.type == "cpu" else 1
    return int(free_memory_bytes(model.device) * fraction) // (bytes_per_token(model) * shared)
