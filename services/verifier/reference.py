"""The oracle: plain Hugging Face `generate`, greedy. Tests and benchmarks compare against it."""

from __future__ import annotations

import torch


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, pad_token_id: int = 0, **generate_kwargs
) -> list[int]:
    """Greedy continuation of prompt_ids by `model.generate`; the generated ids only.
    generate_kwargs reach `generate` (e.g. assistant_model, prompt_lookup_num_tokens)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            **generate_kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()
