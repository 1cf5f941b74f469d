"""Observability around the stages of a step: a span and a timing per stage, in one place.

The engine's step reads as the algorithm (plan, draft, verify, accept, emit); what is traced
and measured about each stage is said here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Histogram

from ..common import telemetry
from ..speculation.tree import DraftTree
from . import metrics
from .sequence import Sequence
from .step_plan import StepPlan


@dataclass
class Timing:
    seconds: float = 0.0


@contextmanager
def stage(name: str, histogram: Histogram | None = None) -> Iterator[Timing]:
    """A span `verifier.<name>` around the stage, and its duration (observed in
    `histogram`, and on the Timing it yields once the stage is done)."""
    timing = Timing()
    started = time.perf_counter()
    with telemetry.tracer.start_as_current_span(f"verifier.{name}"):
        try:
            yield timing
        finally:
            timing.seconds = time.perf_counter() - started
            if histogram is not None:
                histogram.observe(timing.seconds)


@contextmanager
def step_span(plan: StepPlan) -> Iterator[trace.Span]:
    """The step's span, in the trace of its first sampled sequence and linked to the others';
    the plan's metrics."""
    traced = [s.trace_ctx for s in plan.seqs if s.trace_ctx is not None]
    traced.sort(key=lambda c: not trace.get_current_span(c).get_span_context().trace_flags.sampled)
    links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in traced[1:]]
    metrics.BATCH_SIZE.observe(len(plan.parts))
    for part in plan.parts:
        if part.prefilling:
            metrics.PREFILL_TOKENS.inc(part.take)
            metrics.PREFILL_CHUNKS.inc()
    with telemetry.tracer.start_as_current_span(
        "verifier.step", context=traced[0] if traced else None, links=links
    ) as span:
        span.set_attributes({"batch_size": len(plan.parts), "prefill_tokens": plan.prefill_tokens})
        yield span


def drafted(span: trace.Span, trees: list[DraftTree]) -> None:
    span.set_attribute("tree_nodes", sum(map(len, trees)))


def prefilled(seq: Sequence) -> None:
    """A span from admission to the end of the prompt's prefill, in the request's trace."""
    if seq.trace_ctx is None:
        return
    span = telemetry.tracer.start_span(
        "verifier.prefill", context=seq.trace_ctx, start_time=int(seq.admitted_ms * 1e6)
    )
    span.set_attribute("prompt_tokens", len(seq.prompt_ids))
    span.set_attribute("cached_tokens", seq.cached_tokens)
    span.set_attribute("restored_tokens", seq.restored)
    span.end()


def accepted(seq: Sequence, drafted_nodes: int, accepted_tokens: int, emitted: int) -> None:
    """One sequence's step outcome, in the metrics."""
    metrics.DRAFTED_TOKENS.inc(drafted_nodes)
    metrics.ACCEPTED_TOKENS.inc(accepted_tokens)
    metrics.ACCEPTED_LENGTH.observe(emitted)
    metrics.GENERATED_TOKENS.inc(emitted)
