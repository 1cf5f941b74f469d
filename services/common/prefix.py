"""Prefix hashes: one per full KV block, chained, so that a block's hash names its whole prefix.

hash(block i) = H(hash(block i-1), token ids of block i), and block 0's parent is a root made
from the model version and the scope (the tenant, unless `prefix_cache_scope: global`): equal
hashes mean equal tokens from position 0 under the same weights, in the same scope.
The verifier keys its cached blocks by them (kv_cache.py); it publishes a summary of them in its
heartbeat, and the scheduler hashes a waiting prompt the same way to find the verifier that
already holds the longest part of it (placement.py). The hashes are stable across processes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable


def root(model_version: str, scope: str = "") -> int:
    """The parent hash of a sequence's first block: of the model version, and of the scope
    whose sequences may share blocks (a tenant; "" for all, `prefix_cache_scope: global`)."""
    scoped = f"\0{scope}" if scope else ""
    return _digest(b"specserve-prefix\0" + (model_version + scoped).encode())


def scope_of(setting: str, tenant: str) -> str:
    """The prefix scope of a tenant's request under `prefix_cache_scope`."""
    return tenant if setting == "tenant" else ""


def chain(parent: int, token_ids: Iterable[int]) -> int:
    """The hash of a block holding `token_ids`, after the block hashed `parent`."""
    return _digest(parent.to_bytes(8, "little") + array("q", token_ids).tobytes())


def block_hashes(token_ids: list[int], block_size: int, parent: int) -> list[int]:
    """The hashes of the full blocks of `token_ids`, in order (a partial last block has none);
    `parent` is the root of the model version (`root`)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def short(h: int) -> str:
    """A hash as the heartbeat summary writes it: 8 hex digits (32 bits)."""
    return f"{h & 0xFFFFFFFF:08x}"


def cached_blocks(hashes: list[int], summary: set[str]) -> int:
    """How many of a prompt's leading blocks a verifier whose summary is `summary` holds."""
    count = 0
    for h in hashes:
        if short(h) not in summary:
            break
        count += 1
    return count


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
