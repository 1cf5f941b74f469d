"""The proposers, chosen by name (`proposer` in the drafter's settings):
- `ngram` (`ngram.py`): prompt lookup in the sequence's own history. Free, deterministic.
- `draft_model` (`draft_model.py`): a small causal LM grows a tree best-first (EAGLE-2's
  dynamic tree); sampling requests get drawn trees that carry the draft distribution.
- `hybrid` (`hybrid.py`): n-gram where the history repeats itself, the draft model elsewhere.

All of them implement `Proposer` (`proposer.py`).
"""

from __future__ import annotations

from .draft_model import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NgramProposer
from .proposer import Proposer

PROPOSERS: dict[str, type[Proposer]] = {
    p.name: p for p in (NgramProposer, DraftModelProposer, HybridProposer)
}
