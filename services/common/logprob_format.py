"""How a token's log-probabilities travel in a request's output stream (its entries' `lp`
field, ';' between tokens), written by the verifier and read by the gateway.

One token's entry: its log-probability, then `id:logprob` for each of the top tokens at its
position, most likely first, separated by spaces: "-0.0213 1734:-0.0213 578:-4.12".
"""

from __future__ import annotations

MAX_TOP_LOGPROBS = 20  # as OpenAI's API bounds top_logprobs
UNKNOWN = "-"  # the entry of a token generated before a verifier took its request over


def encode(own: float, top: list[tuple[int, float]]) -> str:
    return " ".join([_number(own)] + [f"{i}:{_number(x)}" for i, x in top])


def decode(entry: str) -> tuple[float, list[tuple[int, float]]]:
    """One token's entry: its log-probability, and the (id, log-probability) of the top tokens;
    NaN and none for UNKNOWN (only ever written again if Redis lost a step's writes)."""
    if entry == UNKNOWN:
        return float("nan"), []
    own, *top = entry.split(" ")
    pairs = [p.split(":") for p in top]
    return float(own), [(int(i), float(x)) for i, x in pairs]


def _number(x: float) -> str:
    return f"{x:.7g}"  # float32's precision
