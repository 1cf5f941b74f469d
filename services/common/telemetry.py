"""Structured logs and OpenTelemetry tracing setup, one call per process."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import random
import sys
import time

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)

# Spans made once per decode step, for a whole batch: thousands a minute per verifier.
STEP_SPANS = frozenset({"verifier.step"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Callers pass ids and sizes in `extra`, never prompt text."""

    _skip = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _DrawnRatio(Sampler):
    """Samples `ratio` of the calls, by a draw of its own (whatever the trace id)."""

    def __init__(self, ratio: float):
        self.ratio = ratio

    def should_sample(
        self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
        trace_state=None,
    ) -> SamplingResult:  # fmt: skip
        decision = Decision.RECORD_AND_SAMPLE if random.random() < self.ratio else Decision.DROP
        return SamplingResult(decision, None, trace_state)

    def get_description(self) -> str:
        return f"DrawnRatio{{{self.ratio}}}"


class StepSampler(Sampler):
    """A request's trace is sampled at `ratio` where it starts and followed by every hop
    (ParentBased); a step span (STEP_SPANS), and so what runs under it, is kept for
    `step_ratio` of the steps only, so a minutes-long request's trace holds a sample of its
    steps rather than every one.

    At the `edge` (the gateway) a caller's traceparent gives the trace its id but not its
    decision: a draw of ours at the ratio decides (not the trace id, which the caller
    chose), so a client cannot have every request traced."""

    def __init__(self, ratio: float, step_ratio: float, edge: bool = False):
        by_ratio = TraceIdRatioBased(ratio)
        if edge:
            drawn = _DrawnRatio(ratio)
            self.requests = ParentBased(
                by_ratio, remote_parent_sampled=drawn, remote_parent_not_sampled=drawn
            )
        else:
            self.requests = ParentBased(by_ratio)
        self.step_ratio = step_ratio

    def should_sample(
        self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
        trace_state=None,
    ) -> SamplingResult:  # fmt: skip
        result = self.requests.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )
        if name in STEP_SPANS and result.decision.is_sampled():
            if random.random() >= self.step_ratio:
                return SamplingResult(Decision.DROP, None, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"StepSampler{{{self.requests.get_description()}, steps={self.step_ratio}}}"


def setup(
    service: str,
    log_level: str,
    otlp_endpoint: str | None = None,
    sample_ratio: float = 1.0,
    step_sample_ratio: float = 1.0,
) -> None:
    """JSON logging to stderr (with the current trace id), and a tracer provider named after
    the service that exports OTLP over gRPC to `otlp_endpoint`, or to where the standard
    OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT says (neither: spans are not recorded at all). The
    exporter's other OTEL_EXPORTER_OTLP_* variables (headers, certificates, timeout, ...) and
    OTEL_RESOURCE_ATTRIBUTES apply; OTEL_TRACES_SAMPLER, when set, replaces `StepSampler`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(_add_trace_id)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level)
    from_env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not otlp_endpoint and not from_env:
        return  # the API's no-op tracer: no cost
    resource = Resource.create(
        {
            "service.name": f"specserve-{service}",
            "service.version": _version(),
            "service.instance.id": os.environ.get("POD_NAME")
            or f"{os.uname().nodename}:{os.getpid()}",
            "k8s.pod.name": os.environ.get("POD_NAME", ""),
        }
    )
    sampler = (
        None
        if os.environ.get("OTEL_TRACES_SAMPLER")
        else StepSampler(sample_ratio, step_sample_ratio, edge=service == "gateway")
    )
    if otlp_endpoint:  # (an http:// or https:// scheme says whether it is TLS; none: plaintext)
        exporter = OTLPSpanExporter(
            endpoint=otlp_endpoint, insecure=None if "://" in otlp_endpoint else True
        )
    else:
        exporter = OTLPSpanExporter()  # all from OTEL_EXPORTER_OTLP_*
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def shutdown() -> None:
    """Sends the spans still buffered (at exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def _version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


def _add_trace_id(record: logging.LogRecord) -> bool:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        record.trace_id = f"{ctx.trace_id:032x}"
    return True


tracer = trace.get_tracer("specserve")


def inject(context: Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying a span's context (the current one by default) to the callee."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def extract(metadata) -> Context:
    """The caller's context from gRPC metadata (or any (key, value) pairs)."""
    return propagate.extract({k: v for k, v in metadata or ()})


def traceparent() -> str:
    """The current span's context as a W3C traceparent ('' when not traced)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def from_traceparent(value: str) -> Context:
    return propagate.extract({"traceparent": value} if value else {})
