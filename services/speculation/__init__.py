"""Speculation: what tokens come next, and which of them the target keeps.

- Trees: `tree.py` (a draft token tree, what every proposer returns and the verifier checks).
- Proposers: the interface (`proposer.py`) and each kind: `ngram.py` (prompt lookup),
  `suffix.py` (suffix matching over a sequence's and its tenant's outputs), `draft_model.py`
  (a small causal LM grows a tree best-first), `hybrid.py` (the better of the last two per
  step); `proposers.py` chooses one by name. The model-free ones also serve the verifier's
  local fallback.
- Verification: `acceptance.py` (which drafted tokens the target keeps, greedy or sampled),
  `rejection.py` (the rejection sampler), `sampling.py` (a request's sampling parameters and
  the target's probabilities), `logit_rows.py` (how a step's logit rows are laid out).
- Policy: `policy.py` (how much to draft, priced against this machine's verify cost).
- Structured outputs: `grammar.py` (which tokens a request's grammar allows next).
"""
