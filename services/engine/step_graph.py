"""Decode and tree steps as one compiled call over persistent, bucketed buffers.

With `compile: true`, a step whose sequences each bring at most GRAPH_TOKENS new tokens
(decode tokens, draft trees, short prompts) runs the whole of its layers (embedding, every
layer, KV writes and attention included) as one compiled function of a few index tensors.
Everything else (a step with a longer prompt chunk, a mask over cached entries, token ids
already on the device) runs the eager forward: by design, as CUDA graphs serve decode, not as a
fallback.

Buckets. The step is laid out padded: B sequences by N new tokens, row b * N + i being token i
of sequence b, against L entries of context; B and N are rounded up to powers of two, L to a
multiple of MIN_CONTEXT (padding L to a power of two took the 36M proxy's 8-node tree step at
519 entries from 10.5 ms eager to 13.2 ms; at a multiple of 64, 11.5). Padding rows are token
0 at position 0, write their K/V to a scratch block of the pool that no sequence holds, and
see only their sequence's first entry (a padding sequence's is the scratch slot); they are
dropped before the LM head. The function is compiled with dynamic shapes, so a new bucket runs
the same code (0/1 specialisation gives a batch of one sequence and a one-token step graphs of
their own: 4 in all); every graph is counted (`Compiler.graphs`, the
`*_compiled_graphs_total` metric).

Buffers. Each bucket's index tensors are views of one int64 device buffer, filled from a host
twin (pinned on CUDA) in one non-blocking copy per step; their addresses do not change between
the bucket's steps, which capturing a CUDA graph needs (not built: no device here has run it).
The buffer's tail holds what the step reads outside the graph: the rows that get logits and
the KV moves of paths kept since the last step.

The final norm and the LM head run eagerly on the rows that get logits, as in the eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .batch import Placed, Step

GRAPH_TOKENS = 64  # the most new tokens of one sequence a graph step takes
MIN_CONTEXT = 64


def bucket(n: int, least: int = 1) -> int:
    """n rounded up to a power of two, at least `least`."""
    return max(least, 1 << max(0, n - 1).bit_length())


# The graph's inputs in the buffer, by name: each one's size for a bucket (B, N, L).
FIELDS = {
    "ids": lambda b, n, ell: b * n,
    "positions": lambda b, n, ell: b * n,
    "writes": lambda b, n, ell: b * n,
    "slots": lambda b, n, ell: b * ell,
    "past": lambda b, n, ell: b,
    "news": lambda b, n, ell: b,
    "tree": lambda b, n, ell: b * n * n,
    "rows": lambda b, n, ell: b * n,
}


class Buffers:
    """One bucket's persistent buffer: host twin and device buffer, and the fields' views."""

    def __init__(self, shape: tuple[int, int, int], tail: int, device: torch.device):
        b, n, ell = shape
        self.shape = shape
        self.sizes = {name: size(b, n, ell) for name, size in FIELDS.items()}
        self.head = sum(self.sizes.values())
        self.tail = tail
        total = self.head + tail
        host = torch.zeros(total, dtype=torch.int64)
        self.host = host.pin_memory() if device.type == "cuda" else host
        self.device = self.host if device.type == "cpu" else self.host.to(device)
        self.np = self.host.numpy()
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.fields: dict[str, np.ndarray] = {}
        self.views: dict[str, torch.Tensor] = {}
        at = 0
        for name, size in self.sizes.items():
            self.fields[name] = self.np[at : at + size]
            self.views[name] = self.device[at : at + size]
            at += size
        self.fields["rows"][:] = np.arange(b * n)  # (the kernel's query row of each row)

    def send(self, used: int) -> None:
        """The host twin's first `used` entries to the device buffer (one non-blocking copy)."""
        if self.device is not self.host:
            self.device[:used].copy_(self.host[:used], non_blocking=True)
            self.copied.record()

    def writable(self) -> None:
        """Waits until the last copy out of the host twin is done (on CUDA; long done by the
        time a step's results were read, so this does not stall)."""
        if self.copied is not None:
            self.copied.synchronize()


@dataclass
class Laid:
    """A step laid out in its bucket's buffer."""

    buffers: Buffers
    logit_rows: torch.Tensor  # [R] padded rows that get logits
    logit_counts: list[int]  # [B] how many of them each sequence has
    moves: tuple[torch.Tensor, torch.Tensor] | None
    max_position: int


class StepGraph:
    """A FlatModel's compiled step (single rank): lays steps out in bucketed buffers and runs
    them through one compiled function."""

    def __init__(self, model, compiler):
        self.model = model
        self.body = compiler(self._body)
        self.buffers: dict[tuple[int, int, int], Buffers] = {}
        self._pool = None
        self._scratch = 0
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # layers' views
        self._kv_of = (0, 0)  # the pool tensors' addresses they are views of
        self.steps = 0  # steps run through the graph

    @staticmethod
    def fits(placed: list[Placed]) -> bool:
        """Whether a step runs as a graph step (the rest run eagerly)."""
        return all(
            len(p.token_ids) <= GRAPH_TOKENS and p.mask_from in (None, p.past) for p in placed
        )

    def lay_out(self, step: Step) -> Laid:
        """Fills the step's bucket's host buffer and sends it."""
        pool = self.model.pool
        if pool is not self._pool:  # a new pool: a scratch block of its own for padding
            self._scratch = pool.take(1)[0] * pool.block_size
            self._pool = pool
        placed = step.placed
        news = [len(p.token_ids) for p in placed]
        shape = (
            bucket(len(placed)),
            bucket(max(news)),
            -(-max(len(p.slots) for p in placed) // MIN_CONTEXT) * MIN_CONTEXT,
        )
        moved = sum(len(src) for src, _ in step.moves)
        tail = shape[0] * shape[1] + 2 * moved
        buffers = self.buffers.get(shape)
        if buffers is None or buffers.tail < tail:
            buffers = Buffers(shape, max(tail, 2 * shape[0] * shape[1]), self.model.device)
            self.buffers[shape] = buffers
        buffers.writable()
        _, n_max, _ = shape
        f = buffers.fields
        ids, positions, writes = (f[k].reshape(-1, n_max) for k in ("ids", "positions", "writes"))
        slots = f["slots"].reshape(shape[0], -1)
        tree = f["tree"].reshape(-1, n_max, n_max)
        ids[:] = 0
        positions[:] = 0
        writes[:] = self._scratch
        slots[:] = self._scratch
        f["past"][:] = 0
        f["news"][:] = 0
        tree[:] = 0
        causal = np.tril(np.ones((n_max, n_max), dtype=np.int64))
        logit_rows, counts = [], []
        for i, (p, n) in enumerate(zip(placed, news, strict=True)):
            ids[i, :n] = p.token_ids
            positions[i, :n] = p.positions
            writes[i, :n] = p.slots[p.past :]
            slots[i, : len(p.slots)] = p.slots
            f["past"][i], f["news"][i] = p.past, n
            tree[i, :n, :n] = causal[:n, :n] if p.mask is None else p.mask
            logit_rows.extend(range(i * n_max + p.logits_from, i * n_max + n))
            counts.append(n - p.logits_from)
        at = buffers.head
        parts = [logit_rows]
        if step.moves:
            parts += [
                np.concatenate([src for src, _ in step.moves]),
                np.concatenate([dst for _, dst in step.moves]),
            ]
        views = []
        for part in parts:
            buffers.np[at : at + len(part)] = part
            views.append(buffers.device[at : at + len(part)])
            at += len(part)
        buffers.send(at)
        return Laid(
            buffers,
            views[0],
            counts,
            (views[1], views[2]) if step.moves else None,
            max((max(p.positions) for p in placed), default=0),
        )

    def run(self, laid: Laid) -> list[torch.Tensor]:
        """The step's logits, [rows, vocab] float32 per sequence."""
        model, pool = self.model, self.model.pool
        self.steps += 1
        if laid.moves is not None:
            pool.apply_moves(*laid.moves)
        if self._kv_of != (pool.keys.data_ptr(), pool.values.data_ptr()):  # new or grown
            self._kv = (list(pool.keys.unbind(0)), list(pool.values.unbind(0)))
            self._kv_of = (pool.keys.data_ptr(), pool.values.data_ptr())
        v = laid.buffers.views
        cos, sin = model.rotary(v["positions"], laid.max_position)
        b, n, _ = laid.buffers.shape
        hidden = self.body(
            v["ids"],
            cos,
            sin,
            v["writes"],
            v["slots"].view(b, -1),
            v["past"],
            v["news"],
            v["tree"].view(b, n, n),
            v["rows"],
            *self._kv,
        )
        hidden = model.ops.rms_norm(model.body.norm, hidden[laid.logit_rows])
        logits = model.hf.lm_head(hidden).float()
        return list(torch.split(logits, laid.logit_counts))

    def _body(self, ids, cos, sin, writes, slots, past, news, tree, rows, keys, values):
        """The compiled function: [B * N] padded rows' hidden states after the last layer."""
        model = self.model
        b, ell = slots.shape
        n = tree.shape[1]
        mask = visible(past, news, tree, ell)  # [B, 1, N, L]
        hidden = model.body.embed_tokens(ids)
        for index, layer in enumerate(model.layers):
            q, k, v = layer.front(hidden, cos, sin)
            keys[index].index_put_((writes,), k)
            values[index].index_put_((writes,), v)
            if model.attention == "paged":
                attended = torch.ops.specserve.paged_attention(
                    q, keys[index], values[index], slots, mask, rows, q.shape[-1] ** -0.5
                )
            else:
                attended = padded_attention(q, keys[index], values[index], slots, mask, b, n)
            hidden = layer.back(hidden, attended)
        return hidden


def visible(past, news, tree, ell: int) -> torch.Tensor:
    """[B, 1, N, L] bool: entry j is visible to new token i of sequence b. Every cached entry
    (j < past) and the new tokens the sequence's own [N, N] mask shows (causal for a prompt or
    a decode token, ancestry for a tree); padding rows see entry 0 alone."""
    b, n, _ = tree.shape
    row = torch.arange(n, device=tree.device)[None, :, None]  # [1, N, 1]
    col = torch.arange(ell, device=tree.device)[None, None, :]  # [1, 1, L]
    p, new = past[:, None, None], news[:, None, None]  # [B, 1, 1]
    rel = col - p
    own = torch.gather(tree, 2, rel.clamp(0, n - 1).expand(b, n, ell)) != 0
    sees = (col < p) | ((rel >= 0) & (rel < n) & own)
    padding = row >= new
    return ((sees & ~padding) | (padding & (col == 0)))[:, None].contiguous()


def padded_attention(q, keys, values, slots, mask, b: int, n: int) -> torch.Tensor:
    """SDPA over each sequence's entries gathered by slot: [B * N, heads, head_dim]."""
    k = keys[slots].transpose(1, 2)  # [B, kv_heads, L, head_dim]
    v = values[slots].transpose(1, 2)
    queries = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # [B, heads, N, head_dim]
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(b * n, *q.shape[1:])
