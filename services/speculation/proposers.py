"""The proposers, chosen by name (`proposer` in the drafter's settings):
- `ngram` (`speculation/ngram.py`): prompt lookup in the sequence's own history.
- `suffix` (`speculation/suffix.py`): suffix matching over the sequence's history and
  its tenant's completed outputs; trees scored by frequency, as deep as the match is long.
- `draft_model` (`draft_model.py`): a small causal LM grows a tree best-first (EAGLE-2's
  dynamic tree); sampling requests get drawn trees that carry the draft distribution.
- `hybrid` (`hybrid.py`, the default): per sequence and step, the suffix tree or the draft
  model, whichever is expected to have more tokens accepted.

All of them implement `Proposer` (`speculation/proposer.py`). The model-free ones live in
common: the verifier's local fallback drafts with them too.
"""

from __future__ import annotations

from .draft_model import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NgramProposer
from .proposer import Proposer
from .suffix import SuffixProposer

PROPOSERS: dict[str, type[Proposer]] = {
    p.name: p for p in (NgramProposer, SuffixProposer, DraftModelProposer, HybridProposer)
}
