"""specserve: a speculative-decoding LLM inference service."""

__version__ = "0.1.0"
