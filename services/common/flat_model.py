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

import torch

from .attention import attend, write_kv
from .batch import Batch, Segment
from .compiler import CompileFailed, Compiler
from .kv_cache import BLOCK_SIZE, KVPool, OutOfBlocks, SequenceKV
from .settings import ConfigError

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


class FlatModel:
    """Runs a Hugging Face causal LM of the Qwen2/Llama family over flat batches of Segments.

    Owns the KV pool its sequences' entries live in (`new_kv` hands out a sequence's share)."""

    def __init__(
        self,
        hf_model,
        *,
        kv_tokens: int = 4096,
        block_size: int = BLOCK_SIZE,
        compiler: Compiler | None = None,
    ):
        config = hf_model.config
        if config.model_type not in SUPPORTED:
            raise UnsupportedModel(
                f"model type {config.model_type!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED))}"
            )
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise UnsupportedModel("sliding-window attention layers are not supported")
        self.hf = hf_model
        self.body = hf_model.model
        self.layers = list(self.body.layers)
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.use_pool(kv_tokens, block_size)

        self.compiler = compiler
        self.front, self.back = self._front, self._back
        if compiler is not None:
            self.front, self.back = compiler(self._front), compiler(self._back)

    @classmethod
    def prepare(
        cls, hf_model, *, compile: bool, key: str, on_graph=None, kv_tokens: int = 4096
    ) -> tuple[FlatModel, float]:
        """A FlatModel, compiled when `compile`, and warmed up; with the warm-up's seconds.
        A compile failure stops the start with a ConfigError naming the config `key`."""
        compiler = Compiler(on_graph) if compile else None
        model = cls(hf_model, kv_tokens=kv_tokens, compiler=compiler)
        try:
            seconds = model.warm_up()
        except CompileFailed as e:
            raise ConfigError(
                f"{key}: torch.compile failed for this model, device and dtype ({e}); "
                f"set {key}: false to run eagerly"
            ) from e
        log.info(
            "forward ready",
            extra={"compile": compile, "seconds": round(seconds, 1), "graphs": model.graphs},
        )
        return model, seconds

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (recompiles included); 0 when eager."""
        return self.compiler.graphs if self.compiler else 0

    def warm_up(self) -> float:
        """Runs a prompt step and a decode step once, so that compiling happens now and not in
        the first request's step; returns the seconds it took. Raises CompileFailed."""
        started = time.perf_counter()
        kv = self.new_kv()
        try:
            self.forward([Segment(kv, [0, 0])])
            self.forward([Segment(kv, [0])])
        except Exception as e:
            if self.compiler is None:
                raise
            cause = e  # dynamo wraps what the compiler raised
            while (inner := getattr(cause, "inner_exception", cause.__cause__)) is not None:
                cause = inner
            first = (str(cause).strip().splitlines() or [""])[0]
            raise CompileFailed(f"{type(cause).__name__}: {first}"[:500]) from e
        finally:
            kv.free()
        return time.perf_counter() - started

    def use_pool(
        self, tokens: int, block_size: int, *, fixed: bool = False, model_version: str = ""
    ) -> KVPool:
        """A new, empty KV pool of `tokens` (whole blocks) for this model's sequences: fixed in
        size, or growing as sequences need; its prefix hashes are rooted in `model_version`.
        Sequences of the pool before are no longer valid."""
        self.pool = KVPool(
            len(self.layers),
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
            block_size=block_size,
            blocks=max(1, -(-tokens // block_size)),
            fixed=fixed,
            model_version=model_version,
        )
        return self.pool

    def new_kv(self) -> SequenceKV:
        """An empty KV for one sequence, in this model's pool."""
        return SequenceKV(self.pool)

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Logits (float32) for each segment's rows from logits_from on: [rows, vocab] each."""
        batch = Batch.build(segments, self.device)
        hidden = self.body.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.body.rotary_emb(hidden, batch.positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, head_dim]
        for index, layer in enumerate(self.layers):
            q, k, v = self.front(layer, hidden, cos, sin)
            write_kv(self.pool, index, batch, k, v)
            hidden = self.back(layer, hidden, attend(self.pool, index, batch, q))
        Batch.advance(segments)
        hidden = self.body.norm(hidden[batch.logit_rows])  # [rows, hidden]
        logits = self.hf.lm_head(hidden).float()
        return list(torch.split(logits, batch.logit_counts))

    def _front(self, layer, hidden, cos, sin):
        """The layer up to attention: [T, hidden] -> q [T, heads, head_dim], k and v
        [T, kv_heads, head_dim], rotary positions applied."""
        attn, tokens = layer.self_attn, hidden.shape[0]
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _back(self, layer, hidden, attended):
        """The layer after attention: output projection, residuals and the MLP."""
        hidden = hidden + layer.self_attn.o_proj(attended.reshape(hidden.shape[0], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
