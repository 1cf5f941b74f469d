"""torch.compile for the forward pass, regionally: the two dense halves of a decoder layer
(three pieces on a tensor-parallel rank, whose exchanges sit between them).

A decoder layer is compiled once and that code serves every layer (the layers differ only in
their weights, which are graph inputs). The token count is a dynamic dimension, so a step of
any size runs the same graphs: 0/1 specialisation aside, nothing recompiles as batches change
(recompiles are counted all the same, `Compiler.graphs`). Attention and the KV pool stay
outside the compiled regions: they index the pool in place, which a compiled graph would copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class CompileFailed(RuntimeError):
    """torch.compile cannot compile the forward on this build, device or dtype."""


class Compiler:
    """Compiles functions with inductor and counts the graphs it builds (each is a compile or
    a recompile) and the seconds they took."""

    def __init__(self, on_graph: Callable[[float], None] | None = None):
        self.graphs = 0
        self.seconds = 0.0
        self._on_graph = on_graph

    def __call__(self, fn: Callable) -> Callable:
        return torch.compile(fn, backend=self._backend, dynamic=True)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        started = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        elapsed = time.perf_counter() - started
        self.graphs += 1
        self.seconds += elapsed
        log.info("compiled a graph", extra={"graphs": self.graphs, "seconds": round(elapsed, 2)})
        if self._on_graph is not None:
            self._on_graph(elapsed)
        return compiled
