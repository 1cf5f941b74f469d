"""The proposers, chosen by name (`proposer` in the drafter's settings):
- `ngram` (`common/proposers/ngram.py`): prompt lookup in the sequence's own history.
- `suffix` (`common/proposers/suffix.py`): suffix matching over the sequence's history and
  its tenant's completed outputs; trees scored by frequency, as deep as the match is long.
- `draft_model` (`draft_model.py`): a small causal LM grows a tree best-first (EAGLE-2's
  dynamic tree); sampling requests get drawn trees that carry the draft distribution.
- `hybrid` (`hybrid.py`, the default): per sequence and step, the suffix tree or the draft
  model, whichever is expected to have more tokens accepted.

All of them implement `Proposer` (`common/proposers/base.py`). The model-free ones live in
common: the verifier's local fallback drafts with them too.
"""

from __future__ import annotations

from ..common.proposers.base import Proposer
from ..common.proposers.ngram import NgramProposer
from ..common.proposers.suffix import SuffixProposer
from .draft_model import DraftModelProposer
from .hybrid import HybridProposer

PROPOSERS: dict[str, type[Proposer]] = {
    p.name: p for p in (NgramProposer, SuffixProposer, DraftModelProposer, HybridProposer)
}
