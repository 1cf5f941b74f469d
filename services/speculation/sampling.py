"""Sampling parameters and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy: logits / T would overflow float32 for T near 0
# (T = 1e-40 makes every logit inf), and what it approaches is the argmax anyway.
GREEDY_BELOW = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; so is anything below GREEDY_BELOW
    top_p: float = 0.0  # 0 or 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filters(self, vocab: int) -> bool:
        """Whether top-k or top-p cut the distribution over a vocabulary of `vocab` tokens
        (else it is softmax at the temperature alone)."""
        return 0 < self.top_k < vocab or 0.0 < self.top_p < 1.0


def make_generator(
    params: SamplingParams, device: str | torch.device = "cpu"
) -> torch.Generator | None:
    """The sequence's random source, on the device its logits are on (None when greedy)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted by top-k and top-p.

    logits: [vocab] or [rows, vocab] float, each row on its own. Returns float32 probabilities
    of the same shape, each row summing to 1.
    """
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)
