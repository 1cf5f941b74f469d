"""torch.compile for the forward pass: a single rank's decode and tree steps as one graph
(step_graph.py), a tensor-parallel rank's layer halves between its exchanges (one code for
every layer, the layers' weights being graph inputs).

Sizes are dynamic, so steps of any shape run the same graph; every graph built, first compiles
and recompiles alike, is counted (`Compiler.graphs`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.fx.experimental._config as shape_config

log = logging.getLogger(__name__)

# Symbolic sizes that stay apart: no two sizes share a symbol because they were equal when a
# graph was traced (duck sizing). With torch's default the graph step compiled a new graph for
# such coincidences (7 graphs over 20 shapes of batches, trees and prompts on the proxy, and
# past torch's limit of 8 in a benchmark's run, after which dynamo runs new shapes eagerly);
# with this, 6: one or several sequences, by one or several tokens, an own mask of one entry
# or more (0/1 specialisation), and with size-oblivious guards, 1 (which inductor's lowering of
# SDPA on the CPU refuses: its strides fail an assertion; the paged kernel's graph takes them).
SHAPES = {"use_duck_shape": False}


class CompileFailed(RuntimeError):
    """torch.compile cannot compile the forward on this build, device or dtype."""


class Compiler:
    """Compiles functions with inductor and counts the graphs it builds (each is a compile or
    a recompile) and the seconds they took."""

    def __init__(self, on_graph: Callable[[float], None] | None = None):
        self.graphs = 0
        self.seconds = 0.0
        self._on_graph = on_graph

    def __call__(self, fn: Callable, *, size_oblivious: bool = False) -> Callable:
        """fn compiled; `size_oblivious`: sizes are not specialised on being 1 where the graph
        means the same either way (one graph where 0/1 specialisation makes several)."""
        compiled = torch.compile(fn, backend=self._backend, dynamic=True)
        shapes = SHAPES | {"backed_size_oblivious": size_oblivious}

        @functools.wraps(fn)
        def call(*args):
            with shape_config.patch(shapes):
                return compiled(*args)

        return call

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
