"""Sampling parameters: top-k and top-p restrict the target's distribution."""

from __future__ import annotations

import torch

from specserve.speculation.sampling import SamplingParams, target_probs


def test_top_k_and_top_p_restrict_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))
