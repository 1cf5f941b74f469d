"""The forward pass that serves and drafts: many sequences in one flat batch, tree attention.

A Hugging Face Qwen2 / Llama model provides the weights and the per-token modules (embedding,
norms, projections, MLP, rotary embedding); this module runs them over a step's batch:

- All new tokens of all sequences go through the linear layers as one [tokens, hidden] matrix
  (batch.py lays the step out once; every layer shares the layout).
- Attention is one call per layer for the whole step (attention.py), reading each sequence's
  KV through its block table in the model's pool (kv_cache.py), with a mask that is causal for
  a prompt and prefix plus ancestors for the nodes of a draft tree.
- Only the rows that need logits go through the final norm and the LM head.

Plain Hugging Face forward passes are the reference this is tested against.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .attention import attend, attend_paged, write_kv
from .batch import Batch, Segment, Step, place
from .compiler import CompileFailed, Compiler
from .gemm import column_major_head
from .hugepages import to_huge_pages
from .kv_cache import BLOCK_SIZE, KVPool, OutOfBlocks, SequenceKV
from .layers import CpuOps, DecoderLayer, Int4Layers, RotaryTable, layer_ops
from .step_graph import StepGraph, graph_shapes
from .tensor_parallel import Shards, ShardsLost

log = logging.getLogger(__name__)

SUPPORTED = {"qwen2", "llama"}

__all__ = [
    "CompileFailed",
    "Compiler",
    "FlatModel",
    "OutOfBlocks",
    "Segment",
    "SequenceKV",
    "UnsupportedModel",
]


class UnsupportedModel(ValueError):
    """The model's architecture is not one this forward implements."""


class UnsupportedAttention(ValueError):
    """The attention kernel asked for does not run for this model, device and dtype."""


ATTENTION = ("auto", "padded", "paged")


@dataclass(frozen=True)
class PoolShape:
    """Rank 0 to the other ranks: a new, empty KV pool of this many tokens, in these blocks."""

    tokens: int
    block_size: int


class FlatModel:
    """Runs a Hugging Face causal LM of the Qwen2/Llama family over flat batches of Segments.

    Owns the KV pool its sequences' entries live in (`new_kv` hands out a sequence's share).
    With `shards`, the model is one rank's shard of a tensor-parallel model
    (tensor_parallel.py): rank 0 plans each step and sends it to the other ranks, which run it
    through `run` alone; only rank 0 gets logits."""

    def __init__(
        self,
        hf_model,
        *,
        kv_tokens: int = 4096,
        block_size: int = BLOCK_SIZE,
        compiler: Compiler | None = None,
        shards: Shards | None = None,
        attention: str = "auto",
    ):
        config = hf_model.config
        if config.model_type not in SUPPORTED:
            raise UnsupportedModel(
                f"model type {config.model_type!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED))}"
            )
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise UnsupportedModel("sliding-window attention layers are not supported")
        column_major_head(hf_model)  # (a CPU's BLAS multiplies one row by it faster)
        self.hf = hf_model
        self.body = hf_model.model
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.ops = layer_ops(hf_model)
        self.layers = [
            DecoderLayer(layer, self.num_heads, self.kv_heads, self.head_dim, self.ops)
            for layer in self.body.layers
        ]
        self.attention = self._attention(attention)
        self.attend = attend_paged if self.attention == "paged" else attend
        # int4 layers on the CPU kernels: a step's layers as one call (Int4Layers)
        fused = self.attention == "paged" and shards is None and Int4Layers.fits(self.layers)
        self.int4_layers = Int4Layers(self.layers) if fused else None
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, param.device
        if self.device.type == "cpu":
            modules = [*hf_model.modules(), *(m for layer in self.layers for m in layer.modules())]
            if moved := to_huge_pages(modules):
                log.info("quantised weights on huge pages", extra={"bytes": moved})
        self.rotary = RotaryTable(self.body.rotary_emb, self.dtype, self.device)
        self.shards = shards
        if shards is not None:
            shards.vocab_start = shards.rank * self.body.embed_tokens.num_embeddings
        self.compiler = compiler
        # Compiled: a single rank's decode and tree steps as one graph (step_graph.py); a
        # tensor-parallel rank's layer halves between its exchanges, one code for every layer.
        self.graph = StepGraph(self, compiler) if compiler and shards is None else None
        self.use_pool(kv_tokens, block_size)

        self.front, self.back = DecoderLayer.front, DecoderLayer.back
        self.out, self.mlp = DecoderLayer.out, DecoderLayer.mlp
        if compiler is not None and shards is not None:
            self.front = compiler(DecoderLayer.front)
            self.out, self.mlp = compiler(DecoderLayer.out), compiler(DecoderLayer.mlp)

    def _attention(self, asked: str) -> str:
        """The attention kernel to run: `asked`, or for auto paged where it runs (the engine's
        CPU kernels loaded for float32 activations; head_dim a multiple of 8)."""
        if asked not in ATTENTION:
            raise UnsupportedAttention(f"attention {asked!r}: one of {', '.join(ATTENTION)}")
        runs = isinstance(self.ops, CpuOps) and self.head_dim % 8 == 0
        if asked == "paged" and not runs:
            raise UnsupportedAttention(
                "paged attention runs on a CPU with the engine's kernels built, float32 "
                "activations (float32, int8 or int4 weights) and head_dim a multiple of 8; "
                "use auto or padded"
            )
        return asked if asked != "auto" else "paged" if runs else "padded"

    @classmethod
    def prepare(
        cls,
        hf_model,
        *,
        compile: bool,
        key: str,
        on_graph=None,
        kv_tokens: int = 4096,
        shards: Shards | None = None,
        attention: str = "auto",
    ) -> tuple[FlatModel, float]:
        """A FlatModel, compiled when `compile`, and warmed up; with the warm-up's seconds.
        A compile failure raises CompileFailed naming the config `key` (the caller's start
        stops on it)."""
        compiler = Compiler(on_graph) if compile else None
        model = cls(
            hf_model, kv_tokens=kv_tokens, compiler=compiler, shards=shards, attention=attention
        )
        try:
            seconds = model.warm_up()
        except CompileFailed as e:
            raise CompileFailed(
                f"{key}: torch.compile failed for this model, device and dtype ({e}); "
                f"set {key}: false to run eagerly"
            ) from e
        log.info(
            "forward ready",
            extra={
                "compile": compile,
                "attention": model.attention,
                "seconds": round(seconds, 1),
                "graphs": model.graphs,
            },
        )
        return model, seconds

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (recompiles included); 0 when eager."""
        return self.compiler.graphs if self.compiler else 0

    def warm_up(self) -> float:
        """Runs a prompt step and a decode step once (compiled: of one and of two sequences),
        so that compiling happens now and not in a request's step; returns the seconds it
        took. Raises CompileFailed."""
        started = time.perf_counter()
        kv, other = self.new_kv(), self.new_kv()
        try:
            self.forward([Segment(kv, [0, 0])])
            self.forward([Segment(kv, [0])])
            if self.graph is not None:  # its other graphs (0/1 specialisation: graph_shapes)
                for kvs in ([kv], [kv, other]):
                    for segment in graph_shapes():
                        self.forward([segment(k) for k in kvs])
        except Exception as e:
            if self.compiler is None or isinstance(e, ShardsLost):
                raise
            cause = e  # dynamo wraps what the compiler raised
            while (inner := getattr(cause, "inner_exception", cause.__cause__)) is not None:
                cause = inner
            first = (str(cause).strip().splitlines() or [""])[0]
            raise CompileFailed(f"{type(cause).__name__}: {first}"[:500]) from e
        finally:
            kv.free()
            other.free()
        return time.perf_counter() - started

    def use_pool(
        self, tokens: int, block_size: int, *, fixed: bool = False, model_version: str = ""
    ) -> KVPool:
        """A new, empty KV pool of `tokens` (whole blocks) for this model's sequences: fixed in
        size, or growing as sequences need; its prefix hashes are rooted in `model_version`.
        Sequences of the pool before are no longer valid."""
        if self.shards is not None:  # the ranks' pools never grow: all must stay the same
            fixed = True
            if self.shards.leader:
                self._send(PoolShape(tokens, block_size))
        self.pool = KVPool(
            len(self.layers),
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
            block_size=block_size,
            blocks=max(1, -(-tokens // block_size)) + (self.graph is not None),  # (scratch)
            fixed=fixed,
            model_version=model_version,
        )
        if self.graph is not None:
            self.graph.adopt(self.pool)
        return self.pool

    def new_kv(self) -> SequenceKV:
        """An empty KV for one sequence, in this model's pool."""
        return SequenceKV(self.pool)

    @torch.inference_mode()
    def forward(
        self, segments: list[Segment], input_ids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Logits (float32) for each segment's rows from logits_from on: [rows, vocab] each.
        `input_ids` ([T] on the device, in segment order) replaces the segments' token ids,
        which then only count the tokens: what a pass computed feeds the next without a read
        (one rank only). With shards, the other ranks run the same step; from the moment it
        is sent, any failure (theirs or this rank's: the ranks would be out of step) raises
        ShardsLost."""
        if input_ids is not None and self.shards is not None:
            raise ValueError("token ids on the device are not sent to the other ranks")
        step = Step(place(segments), self.pool.take_moves())
        graph = self.graph if self.graph is not None and self.graph.fits(step.placed) else None
        try:  # (a layout error stops this step alone)
            batch = graph.lay_out(step) if graph else Batch.of(step, self.device)
        except Exception:
            self.pool.put_back(step.moves)  # (the next pass makes them)
            raise
        if graph is not None:
            if input_ids is not None:  # (the graph's rows are in segment order too)
                batch.inputs["ids"][: len(input_ids)].copy_(input_ids)
            logits = graph.run(batch)
        elif self.shards is None:
            if input_ids is not None:
                batch.input_ids = input_ids
            logits = self.run(step, batch)
        else:
            self._send(step)
            try:
                logits = self.run(step, batch)
            except BaseException as e:
                raise self._lost(e) from e
        Batch.advance(segments)
        return logits

    @torch.inference_mode()
    def run(self, step: Step, batch: Batch | None = None) -> list[torch.Tensor]:
        """Runs a planned step on this rank's weights and KV: every rank of a tensor-parallel
        model runs each step (the others from what rank 0 sent); logits come back on rank 0."""
        if batch is None:
            batch = Batch.of(step, self.device)
        if batch.moves is not None:  # the paths kept since the last step, first
            self.pool.apply_moves(*batch.moves)
        shards = self.shards
        if shards is None:
            hidden = self.body.embed_tokens(batch.input_ids)  # [T, hidden]
        else:
            hidden = shards.embed(self.body.embed_tokens, batch.input_ids)
        cos, sin = self.rotary(batch.positions, batch.max_position)  # [T, 1, head_dim]
        if self.int4_layers is not None and len(batch.groups) == 1:
            hidden = self.int4_layers(self.pool, batch, hidden, cos, sin)
        else:
            hidden = self.layer_by_layer(batch, hidden, cos, sin)
        hidden = self.ops.rms_norm(self.body.norm, hidden[batch.logit_rows])  # [rows, hidden]
        logits = self.hf.lm_head(hidden).float()
        if shards is not None and (logits := shards.gather_vocab(logits)) is None:
            return []
        return list(torch.split(logits, batch.logit_counts))

    def layer_by_layer(self, batch: Batch, hidden, cos, sin) -> torch.Tensor:
        """hidden [T, hidden] through every layer, one module call at a time."""
        shards = self.shards
        for index, layer in enumerate(self.layers):
            q, k, v = self.front(layer, hidden, cos, sin)
            write_kv(self.pool, index, batch, k, v)
            attended = self.attend(self.pool, index, batch, q)
            if shards is None:
                hidden = self.back(layer, hidden, attended)
            else:  # row-parallel products: each rank's is a partial sum
                hidden = hidden + shards.reduce(self.out(layer, attended))
                hidden = hidden + shards.reduce(self.mlp(layer, hidden))
        return hidden

    def follow(self) -> None:
        """The other ranks' loop: runs what rank 0 sends until it sends None (stop)."""
        while (message := self.shards.receive()) is not None:
            if isinstance(message, PoolShape):
                self.use_pool(message.tokens, message.block_size)
            else:
                self.run(message)

    def _send(self, message) -> None:
        if self.shards.lost:
            raise ShardsLost(self.shards.lost)
        try:
            self.shards.send(message)
        except Exception as e:
            raise self._lost(e) from e

    def _lost(self, error: Exception) -> ShardsLost:
        """The group is broken (a rank died or hangs, or this one failed mid-step: the others
        are out of step with it). Every later call raises."""
        if not isinstance(error, ShardsLost):
            lines = str(error).strip().splitlines()
            self.shards.lost = f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
        return ShardsLost(self.shards.lost)
