"""The target's log-probabilities of the tokens a step emits, read off the logits its verify
pass already computed: no pass of its own, and with speculation on or off the same numbers
(up to float rounding), since a draft tree's row for a position is the row plain decoding
computes there.

A sequence's emitted tokens are its accepted nodes' tokens, then the bonus token; the row
each was chosen from is row 0 (after the root) for the first, and the row after each accepted
node for the rest. Those rows, for every sequence of the step that asked, are log-softmaxed
together in float32 on the logits' device, and each token's own entry and the top-k of its row
cross to the host in one transfer for the step.

The distribution is the model's own, before temperature, top-k and top-p (what vLLM returns by
default, and what evaluation harnesses score with).

The entries are encoded as the output stream carries them (common/logprob_format.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..common.logprob_format import encode
from ..speculation.acceptance import Verdict

log = logging.getLogger(__name__)


def path_rows(verdict: Verdict) -> list[int]:
    """The row of the logits each emitted token was chosen from."""
    return [0] + [node + 1 for node in verdict.accepted]


def score(logits: Sequence[torch.Tensor], verdicts: Sequence[Verdict], tops: Sequence[int]) -> None:
    """Sets each verdict's `logprobs` (one encoded entry per token) from its sequence's logits,
    with `tops[i]` top tokens each; one device-to-host transfer for them all. If scoring them
    together fails, each is scored alone, and one that still fails keeps `logprobs` None."""
    if not verdicts:
        return
    try:
        _score(logits, verdicts, tops)
    except Exception:
        if len(verdicts) == 1:
            log.exception("log-probabilities failed for a request")
            return
        for rows, verdict, top in zip(logits, verdicts, tops, strict=True):
            score([rows], [verdict], [top])


def _score(logits: Sequence[torch.Tensor], verdicts: Sequence[Verdict], tops: Sequence[int]):
    rows = torch.cat(
        [rows[path_rows(v)] for rows, v in zip(logits, verdicts, strict=True)]
    )  # [tokens, vocab]
    device = rows.device
    tokens = torch.tensor([t for v in verdicts for t in v.tokens], device=device)
    lp = torch.log_softmax(rows.float(), -1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]  # [tokens]
    k = max(tops)
    parts = [chosen.double()]
    if k:
        top = lp.topk(k, -1)
        parts += [top.indices.flatten().double(), top.values.flatten().double()]
    flat = torch.cat(parts).tolist()  # the one transfer
    n = len(flat) // (1 + 2 * k)
    ids, values = flat[n : n + n * k], flat[n + n * k :]
    row = 0
    for v, top_count in zip(verdicts, tops, strict=True):
        entries = []
        for _ in v.tokens:
            top = [(int(ids[i]), values[i]) for i in range(row * k, row * k + top_count)]
            entries.append(encode(flat[row], top))
            row += 1
        v.logprobs = entries
