"""How much KV cache a request takes: the one rule verifier admission, scheduler placement and
gateway validation share."""

from __future__ import annotations


def kv_need(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> int:
    """KV entries a sequence may hold at most: its prompt and every token it may generate
    (tree nodes included: the speculator never drafts past max_tokens), up to max_seq_len."""
    return min(prompt_tokens + max_tokens, max_seq_len)


def kv_fit_problem(
    prompt_tokens: int, max_tokens: int, budget: int, max_seq_len: int
) -> str | None:
    """Why a request can never fit a verifier with this KV budget; None if it can."""
    need = kv_need(prompt_tokens, max_tokens, max_seq_len)
    if need <= budget:
        return None
    return (
        f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs up to {need} "
        f"KV cache tokens, more than any verifier has ({budget}); shorten the prompt or "
        "lower max_tokens"
    )
