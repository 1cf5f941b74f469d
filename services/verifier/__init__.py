"""Verifier: owns the target model and its KV cache; runs the decode loop of its batch."""
