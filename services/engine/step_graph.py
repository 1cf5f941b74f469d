"""Decode and tree steps as one compiled call over a persistent step buffer.

With `compile: true`, a step whose sequences each bring at most GRAPH_TOKENS new tokens
(decode tokens, draft trees, a draft model's chain and tree levels, short prompts) runs the
whole of its layers (embedding, every layer, KV writes and attention included) as one compiled
function of a few index tensors. A step with a longer prompt chunk (or an own mask wider than
GRAPH_WIDTH) runs the eager forward: by design, as CUDA graphs serve decode, not as a
fallback.

Layout. The step's T new tokens are rows in sequence order, as in the eager forward; attention
sees B sequences by N new tokens against L entries of context, with one [B, 1, N, L] mask built
inside the graph from each sequence's new token count, where its own mask starts, and that
[N, W] mask (causal over the new tokens for a prompt or a decode token, ancestry for a
verifier's tree; a draft model's tree level also sees the levels fed before it, from its
committed tokens on); every entry before the own mask's start is seen. The function is
compiled with dynamic shapes (compiler.py), so every step shape runs one graph with the paged
kernel, or one of 6 with SDPA (one or several sequences, tokens, own mask columns: 0/1
specialisation); the warm-up compiles them (`graph_shapes`) and every graph is counted
(`Compiler.graphs`, the `*_compiled_graphs_total` metric).

Buckets. On CUDA, T, B, N and W are rounded up to powers of two and L to a power of two of
at least MIN_CONTEXT, so that a bucket's tensors keep their shapes and addresses from step to
step, as capturing a CUDA graph needs (capture itself is not built: no device here has run
it). Padding rows are token 0 at position 0 and write their K/V to a scratch block of the pool
that no sequence holds; padding queries see only their sequence's first entry (a padding
sequence's is the scratch slot). On a CPU nothing is padded: padding costs compute there (a
16-node tree's step of the default target rounded up to 32 rows took 253 ms against 147 ms
eager), and no graph is captured.

Buffer. The index tensors are views of one int64 device buffer, filled from the host (on CUDA
from two pinned twins in turn) in one non-blocking copy per step; it grows by doubling when a
step needs more. Its tail holds what the step reads outside the graph: the rows that get logits
and the KV moves of paths kept since the last step. The final norm and the LM head run eagerly
on the rows that get logits, as in the eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import attend_group, paged_group
from .batch import AttentionGroup, Placed, Segment, Step

GRAPH_TOKENS = 64  # the most new tokens of one sequence a graph step takes
GRAPH_WIDTH = 128  # the widest own mask (entries it covers) a graph step takes
MIN_CONTEXT = 64  # the least context bucket (CUDA)


def bucket(n: int, least: int = 1) -> int:
    """n rounded up to a power of two, at least `least`."""
    return max(least, 1 << max(0, n - 1).bit_length())


class StepBuffer:
    """The persistent int64 buffer the graph's index tensors are views of. On CUDA it is filled
    from two pinned host twins in turn, each with an event that marks the copy out of it done,
    so that the host lays out a step while the last one's copy may still wait in the stream."""

    def __init__(self, device: torch.device, size: int = 1 << 14):
        self.target = device
        self.cuda = device.type == "cuda"
        self.turn = 0
        self._allocate(size)

    @torch.inference_mode()  # (as the pool's: a graph's guards tell the two kinds apart)
    def _allocate(self, size: int) -> None:
        self.size = size
        if not self.cuda:  # (the host is the device: one buffer)
            self.device = torch.zeros(size, dtype=torch.int64)
            self.hosts, self.copied = [self.device], [None]
            return
        self.device = torch.zeros(size, dtype=torch.int64, device=self.target)
        self.hosts = [torch.zeros(size, dtype=torch.int64).pin_memory() for _ in range(2)]
        with torch.cuda.device(self.target):
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]

    def writable(self, size: int) -> np.ndarray:
        """The next host twin, with room for `size` entries, once the copy out of it two steps
        ago is done."""
        if size > self.size:
            self._allocate(max(size, 2 * self.size))
        self.turn = (self.turn + 1) % len(self.hosts)
        if (copied := self.copied[self.turn]) is not None:
            copied.synchronize()
        return self.hosts[self.turn].numpy()

    def send(self, used: int) -> None:
        """The host twin's first `used` entries to the device (one non-blocking copy)."""
        if self.cuda:
            self.device[:used].copy_(self.hosts[self.turn][:used], non_blocking=True)
            self.copied[self.turn].record(torch.cuda.current_stream(self.target))


@dataclass
class Laid:
    """A step laid out in the buffer: the graph's inputs and what is read outside it."""

    inputs: dict[str, torch.Tensor]
    logit_rows: torch.Tensor  # [R] rows that get logits
    logit_counts: list[int]  # [B] how many of them each sequence has
    moves: tuple[torch.Tensor, torch.Tensor] | None
    max_position: int


class StepGraph:
    """A FlatModel's compiled step (single rank): lays steps out in the step buffer and runs
    them through one compiled function."""

    def __init__(self, model, compiler):
        self.model = model
        self.body = compiler(self._body, size_oblivious=model.attention == "paged")
        self.buffer = StepBuffer(model.device)
        self.padded = model.device.type == "cuda"  # (buckets: see the module's doc)
        self._scratch = 0  # the slot padding writes to, in a block of the pool no one holds
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # layers' views
        self._kv_of = (0, 0)  # the pool tensors' addresses they are views of
        self.steps = 0  # steps run through the graph

    @torch.inference_mode()
    def adopt(self, pool) -> None:
        """A new pool: a scratch block of its own for padding, taken before any sequence's (a
        fixed pool is made one block larger for it) and zeroed (padding columns read it: SDPA
        masks them by adding -inf, which leaves a NaN a NaN)."""
        block = pool.take(1)[0]
        self._scratch = block * pool.block_size
        for tensor in (pool.keys, pool.values):
            tensor[:, self._scratch : self._scratch + pool.block_size] = 0
        self._kv, self._kv_of = ([], []), (0, 0)  # (the last pool's views let it go)

    @staticmethod
    def fits(placed: list[Placed]) -> bool:
        """Whether a step runs as a graph step (the rest run eagerly)."""
        return all(len(p.token_ids) <= GRAPH_TOKENS and _width(p) <= GRAPH_WIDTH for p in placed)

    def lay_out(self, step: Step) -> Laid:
        """Fills the host buffer with the step's layout and sends it."""
        placed = step.placed
        news = [len(p.token_ids) for p in placed]
        t, b, n, ell = sum(news), len(placed), max(news), max(len(p.slots) for p in placed)
        w = max(map(_width, placed))
        if self.padded:
            t, b, n, ell = bucket(t), bucket(b), bucket(n), bucket(ell, MIN_CONTEXT)
            w = bucket(w)
        starts = np.cumsum([0, *news[:-1]])
        logit_rows = np.concatenate(
            [
                np.arange(s + p.logits_from, s + k)
                for p, s, k in zip(placed, starts, news, strict=True)
            ]
        )
        moves = [np.concatenate(a) for a in zip(*step.moves, strict=True)] if step.moves else []
        sizes = {
            "ids": t,
            "positions": t,
            "writes": t,
            "rows": t,  # each row's padded row (b * N + i): the kernel's query row
            "queries": b * n,  # each padded query's row (padding: row 0)
            "slots": b * ell,
            "starts": b,  # where each sequence's own mask starts
            "news": b,
            "own": b * n * w,
        }
        head = sum(sizes.values())
        used = head + len(logit_rows) + sum(len(m) for m in moves)
        host = self.buffer.writable(used)
        host[:head] = 0
        f = carve(host, sizes)
        f["writes"][:] = self._scratch
        f["slots"][:] = self._scratch
        live = sum(news)
        f["ids"][:live] = [token for p in placed for token in p.token_ids]
        f["positions"][:live] = [position for p in placed for position in p.positions]
        f["writes"][:live] = np.concatenate([p.slots[p.past :] for p in placed])
        f["starts"][: len(placed)] = [p.past + len(p.token_ids) - _width(p) for p in placed]
        f["news"][: len(placed)] = news
        queries, slots = f["queries"].reshape(b, n), f["slots"].reshape(b, ell)
        own = f["own"].reshape(b, n, w)
        for i, (p, s, k) in enumerate(zip(placed, starts, news, strict=True)):
            f["rows"][s : s + k] = i * n + np.arange(k)
            queries[i, :k] = s + np.arange(k)
            slots[i, : len(p.slots)] = p.slots
            own[i, :k, : _width(p)] = np.tri(k, dtype=np.int64) if p.mask is None else p.mask
        host[head:used] = np.concatenate([logit_rows, *moves])
        self.buffer.send(used)
        inputs = carve(self.buffer.device, sizes)
        inputs["queries"] = inputs["queries"].view(b, n)
        inputs["slots"] = inputs["slots"].view(b, ell)
        inputs["own"] = inputs["own"].view(b, n, w)
        tail = self.buffer.device[head:used]
        r, m = len(logit_rows), len(moves[0]) if moves else 0
        return Laid(
            inputs,
            tail[:r],
            [k - p.logits_from for p, k in zip(placed, news, strict=True)],
            (tail[r : r + m], tail[r + m :]) if moves else None,
            max(max(p.positions) for p in placed),
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
        x = laid.inputs
        cos, sin = model.rotary(x["positions"], laid.max_position)
        hidden = self.body(
            x["ids"],
            cos,
            sin,
            x["writes"],
            x["rows"],
            x["queries"],
            x["slots"],
            x["starts"],
            x["news"],
            x["own"],
            *self._kv,
        )
        hidden = model.ops.rms_norm(model.body.norm, hidden[laid.logit_rows])
        logits = model.hf.lm_head(hidden).float()
        return list(torch.split(logits, laid.logit_counts))

    def _body(self, ids, cos, sin, writes, rows, queries, slots, starts, news, own, keys, values):
        """The compiled function: the [T] rows' hidden states after the last layer."""
        model = self.model
        b, n = queries.shape
        group = AttentionGroup(  # (the eager path's one-group layout: attention.py reads it)
            rows=None,
            kv_slots=slots,
            kv_range=None,
            query_index=queries.flatten(),
            output_index=rows,
            mask=visible(starts, news, own, slots.shape[1]),  # [B, 1, N, L]
            shape=(b, n, slots.shape[1]),
        )
        kernel = paged_group if model.attention == "paged" else attend_group
        pool = LayerViews(keys, values)
        hidden = model.body.embed_tokens(ids)
        for index, layer in enumerate(model.layers):
            q, k, v = layer.front(hidden, cos, sin)
            keys[index].index_put_((writes,), k)
            values[index].index_put_((writes,), v)
            hidden = layer.back(hidden, kernel(pool, index, group, q))
        return hidden


@dataclass
class LayerViews:
    """The pool's keys and values as the graph takes them, one view a layer (what attention.py
    indexes a pool's by)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def visible(starts, news, own, ell: int) -> torch.Tensor:
    """[B, 1, N, L] bool: entry j is visible to new token i of sequence b. Every entry before
    the sequence's own mask starts, and from there the ones its [N, W] own mask shows;
    padding queries see entry 0 alone."""
    b, n, w = own.shape
    row = torch.arange(n, device=own.device)[None, :, None]  # [1, N, 1]
    col = torch.arange(ell, device=own.device)[None, None, :]  # [1, 1, L]
    start, new = starts[:, None, None], news[:, None, None]  # [B, 1, 1]
    rel = col - start
    shown = torch.gather(own, 2, rel.clamp(0, w - 1).expand(b, n, ell)) != 0
    sees = (col < start) | ((rel >= 0) & (rel < w) & shown)
    padding = row >= new
    return ((sees & ~padding) | (padding & (col == 0)))[:, None].contiguous()


def graph_shapes() -> list:
    """Segments (functions of a sequence's KV) of every kind of size the graph specialises on
    being 1 or not (with SDPA; the paged kernel's graph does not): 1 or 2 new tokens, an own
    mask over the new tokens alone or also over an entry before them (a draft model's tree
    level). Run with one sequence and with two, they compile every graph at warm-up."""

    def level(kv):  # (one new token seeing the entry before it through its own mask)
        return Segment(kv, [0], mask=np.ones((1, 2), dtype=bool), mask_from=kv.length - 1)

    return [lambda kv: Segment(kv, [0]), lambda kv: Segment(kv, [0, 0]), level]


def carve(flat, sizes: dict[str, int]) -> dict:
    """Consecutive slices of `flat`, one per field, in the order of `sizes`."""
    fields, at = {}, 0
    for name, size in sizes.items():
        fields[name], at = flat[at : at + size], at + size
    return fields


def _width(p: Placed) -> int:
    """The entries a placed segment's own mask covers: its new tokens, and the entries from
    mask_from on before them."""
    if p.mask is None or p.mask_from is None:  # (without a mask, mask_from means nothing)
        return len(p.token_ids)
    return len(p.token_ids) + p.past - p.mask_from
