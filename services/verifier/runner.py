"""Owns the target model and runs its forward passes; the only code that touches KV caches."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from .sequence import Sequence


class ModelRunner:
    """Plain decoding: each step feeds a sequence's unseen tokens and returns its last logits.

    A sequence's cache holds exactly num_computed tokens; the forward appends to it.
    """

    def __init__(self, model, device: str):
        self.model = model
        self.device = device

    @torch.inference_mode()
    def next_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits [vocab] (float32, CPU) after the sequence's last token."""
        pending = seq.pending_input()
        prefill = seq.num_computed == 0
        started = time.perf_counter()
        if seq.cache is None:
            seq.cache = DynamicCache(config=self.model.config)
        input_ids = torch.tensor([pending], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids, past_key_values=seq.cache, use_cache=True, logits_to_keep=1
        )
        seq.num_computed += len(pending)
        if prefill:
            seq.prefill_ms = (time.perf_counter() - started) * 1000
        return out.logits[0, -1].float().cpu()

    @staticmethod
    def release(seq: Sequence) -> None:
        seq.cache = None
        seq.num_computed = 0
