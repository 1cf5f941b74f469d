"""How much KV memory a request takes, in blocks: the one rule that verifier admission,
scheduler placement and gateway validation share.

A verifier's KV is a pool of fixed-size blocks (kv_cache.py). A sequence holds the blocks its
tokens fill, no more: it is admitted when its prompt's blocks are free (less those a cached
prefix supplies), and takes more blocks one at a time as it generates. When the pool runs dry
mid-generation the verifier preempts a sequence and recomputes it later, so admission never
needs the worst case; the worst case only decides whether a request can ever run at all.
"""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` KV entries."""
    return -(-tokens // block_size)


def admission_blocks(tokens: int, cached_blocks: int, block_size: int) -> int:
    """Blocks a sequence takes when it is admitted: its `tokens` (the prompt, or the prompt and
    the output a taken-over request brings) and the first generated token's entry, less the
    blocks a cached prefix already holds."""
    return max(0, blocks_for(tokens + 1, block_size) - cached_blocks)


def kv_need(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> int:
    """KV entries a sequence may hold at most: its prompt and every token it may generate
    (tree nodes included: the speculator never drafts past max_tokens), up to max_seq_len."""
    return min(prompt_tokens + max_tokens, max_seq_len)


def kv_fit_problem(
    prompt_tokens: int, max_tokens: int, budget: int, max_seq_len: int, block_size: int = 1
) -> str | None:
    """Why a request can never run on a verifier whose pool holds `budget` tokens (whole
    blocks of `block_size`), even alone; None if it can."""
    need = kv_need(prompt_tokens, max_tokens, max_seq_len)
    if blocks_for(need, block_size) * block_size <= budget:
        return None
    return (
        f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs up to {need} "
        f"KV cache tokens, more than any verifier has ({budget}); shorten the prompt or "
        "lower max_tokens"
    )
