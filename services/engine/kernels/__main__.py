"""Builds the engine's CPU kernels (`make setup` runs this)."""

import logging

from . import SOURCES, load

logging.basicConfig(level=logging.INFO)
load()
print(f"built: {', '.join(s.name for s in SOURCES)} -> torch.ops.specserve")
