"""Drafter: owns a draft model (or model-free proposer) and per-sequence draft caches."""
