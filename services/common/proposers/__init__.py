"""Proposers that need no model, shared by the drafter and the verifier's local fallback, and
the interface every proposer implements (`base`)."""
