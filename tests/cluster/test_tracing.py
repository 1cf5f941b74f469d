"""What operators see: one trace per request across all four services (the cluster exports
OTLP to a real gRPC OTLP trace collector run by the test), and each service's metrics page."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from conftest import cluster_config
from helpers import generate, request, scrape, wait_until
from specserve.common.telemetry import StepSampler
from specserve.tools.local_cluster import LocalCluster
from specserve.tools.plan import measured_acceptance
from specserve.v1 import generation_pb2_grpc

PROMPT = "def pangolin_checksum(values):"  # must be in no span attribute
SERVICES = {f"specserve-{s}" for s in ("gateway", "scheduler", "verifier", "drafter")}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.environments: set[str] = set()  # the resources' deployment.environment
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                self.environments.add(attrs.get("deployment.environment", ""))
                for scope in resource_spans.scope_spans:
                    self.spans.extend((attrs["service.name"], span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(s, span) for s, span in self.spans if span.trace_id == trace_id]


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_model_dir):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    config = cluster_config(
        tiny_model_dir,
        common={
            "otlp_endpoint": f"http://127.0.0.1:{port}",
            "metrics_port": 0,
            "trace_step_sample_ratio": 1.0,  # every step's spans, to check the whole tree
        },
        verifier={"speculative_decoding": True, "speculation_policy": "fixed"},
    )
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within a tenth of a second
    cluster = LocalCluster(config, tmp_path_factory.mktemp("traced"))
    try:
        cluster.start(timeout=180)
        yield cluster, collector
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        cluster.stop()
        server.stop(0)


def attribute_values(span) -> list[str]:
    return [str(getattr(a.value, a.value.WhichOneof("value"))) for a in span.attributes]


@pytest.mark.cluster
def test_one_request_is_one_trace_across_all_four_services(traced):
    cluster, collector = traced
    with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        generate(stub, request(prompt=PROMPT, max_tokens=8, request_id="traced-1"))

    def whole_trace():
        """The request's spans once every service's are in and every parent is: a span is
        exported when it ends, so a step's spans may come before the request's own."""
        roots = [
            span
            for _, span in list(collector.spans)
            if span.name == "gateway.generate" and "traced-1" in attribute_values(span)
        ]
        spans = collector.trace(roots[0].trace_id) if roots else []
        ids = {span.span_id for _, span in spans}
        names = {span.name for _, span in spans}
        complete = (
            {s for s, _ in spans} >= SERVICES
            and {"drafter.propose", "verifier.step", "verifier.verify"} <= names
            and all(span.parent_span_id in ids for _, span in spans if span.parent_span_id)
        )
        return (roots, spans) if complete else None

    roots, spans = wait_until(whole_trace, "the request's whole trace", timeout=20, every=0.1)
    by_id = {span.span_id: (service, span) for service, span in spans}
    children: dict[bytes, list] = {}
    for service, span in spans:
        if span.parent_span_id:
            assert span.parent_span_id in by_id, f"{span.name} has a parent outside the trace"
            children.setdefault(span.parent_span_id, []).append((service, span))
    top = [span for _, span in spans if not span.parent_span_id]
    assert [span.name for span in top] == ["gateway.generate"]

    def parent_of(name: str) -> str:
        span = next(span for _, span in spans if span.name == name)
        return by_id[span.parent_span_id][1].name

    assert parent_of("gateway.validate") == "gateway.generate"
    assert parent_of("scheduler.submit") == "gateway.generate"
    assert parent_of("scheduler.queue") == "scheduler.submit"  # across the Redis queue
    assert parent_of("scheduler.place") == "scheduler.submit"
    assert parent_of("verifier.admit") == "scheduler.place"
    assert parent_of("verifier.prefill") == "verifier.admit"
    assert parent_of("verifier.step") == "verifier.admit"
    assert parent_of("verifier.verify") == "verifier.step"
    assert parent_of("drafter.propose") == "verifier.draft"
    step = next(span for _, span in spans if span.name == "verifier.step")
    assert {a.key for a in step.attributes} >= {"batch_size", "tree_nodes", "accepted_tokens"}
    for _, span in spans:
        assert not any("pangolin" in v for v in attribute_values(span)), span.name

    def show(span_id: bytes, depth: int) -> None:
        service, span = by_id[span_id]
        ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
        print(f"{'  ' * depth}{span.name} [{service.removeprefix('specserve-')}] {ms:.1f} ms")
        for _, child in sorted(children.get(span_id, []), key=lambda c: c[1].start_time_unix_nano):
            show(child.span_id, depth + 1)

    print(f"\ntrace {roots[0].trace_id.hex()}: {len(spans)} spans")
    show(top[0].span_id, 0)


# What each service's /metrics must list (after the request above has run).
EXPECTED = {
    "gateway": [
        'specserve_gateway_requests_total{pool="stable",priority="interactive",'
        'status="FINISH_REASON_LENGTH"}',
        'specserve_gateway_ttft_seconds_count{pool="stable",priority="interactive"}',
        'specserve_gateway_time_per_output_token_seconds_count{pool="stable",priority="interactive"}',
        'specserve_gateway_drafted_tokens_total{pool="stable"}',
        'specserve_gateway_accepted_tokens_total{pool="stable"}',
        "specserve_gateway_output_tokens_total",
        "specserve_gateway_open_streams",
    ],
    "scheduler": [
        'specserve_scheduler_queue_depth{priority="interactive"}',
        'specserve_scheduler_queue_wait_seconds_count{priority="interactive"}',
        'specserve_scheduler_placed_total{pool="stable",priority="interactive"}',
        "specserve_scheduler_canary_share",
        'specserve_scheduler_live_members{kind="verifier"}',
        'specserve_scheduler_live_members{kind="drafter"}',
    ],
    "verifier": [
        "specserve_verifier_steps_total",
        "specserve_verifier_batch_size_count",
        "specserve_verifier_accepted_length_count",
        "specserve_verifier_drafted_tokens_total",
        "specserve_verifier_accepted_tokens_total",
        "specserve_verifier_draft_seconds_count",
        "specserve_verifier_verify_seconds_count",
        "specserve_verifier_fallback_steps_total",
        "specserve_verifier_kv_budget_tokens",
        "specserve_verifier_kv_used_tokens",
        "specserve_verifier_preemptions_total",
        "specserve_verifier_accelerator_memory_bytes",
    ],
    "drafter": ["specserve_drafter_propose_seconds_count", "specserve_drafter_tree_nodes_count"],
}


def metrics_listing(port: int, names: list[str], timeout: float = 10) -> dict[str, float]:
    """A metrics page once it lists `names` (a series appears when first set: the scheduler
    refreshes its live-member gauges every 0.5 s), or as it is after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not all(n in (page := scrape(port)) for n in names) and time.monotonic() < deadline:
        time.sleep(0.1)
    return page


@pytest.mark.cluster
def test_each_service_lists_its_metrics(traced):
    cluster, _ = traced
    with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
        generate(
            generation_pb2_grpc.GenerationServiceStub(channel), request(prompt="x", max_tokens=4)
        )
    for service, names in EXPECTED.items():
        page = metrics_listing(cluster.procs[service].metrics_port, names)
        assert page["process_resident_memory_bytes"] > 0, service
        missing = [name for name in names if name not in page]
        assert not missing, f"{service} does not list {missing}"
    gateway = scrape(cluster.procs["gateway"].metrics_port)
    assert gateway["specserve_gateway_output_tokens_total"] >= 4
    delivered = gateway["specserve_gateway_delivery_delay_seconds_count"]
    assert delivered >= 1  # (a chunk per stream entry: its tokens' commit to the client's stream)
    assert gateway["specserve_gateway_delivery_delay_seconds_sum"] < 30 * delivered
    # The scheduler refreshes the gauge every 0.5 s: it may still hold the count from before
    # the verifier's first heartbeat.
    live = 'specserve_scheduler_live_members{kind="verifier"}'
    port = cluster.procs["scheduler"].metrics_port
    wait_until(lambda: scrape(port)[live] == 1, "the scheduler counts one live verifier", 10)


@pytest.mark.cluster
def test_the_planner_reads_acceptance_off_a_running_verifier(traced):
    cluster, _ = traced
    port = cluster.procs["verifier"].metrics_port
    page = scrape(port)
    measured = measured_acceptance(f"http://127.0.0.1:{port}/metrics")
    accepted = page["specserve_verifier_accepted_tokens_total"]
    assert measured == accepted / page["specserve_verifier_drafted_tokens_total"]
    assert 0 <= measured <= 1
    info = [k for k in page if k.startswith("specserve_verifier_model_info{")]
    assert len(info) == 1 and 'sha256="' in info[0] and page[info[0]] == 1


def test_step_spans_are_kept_at_their_own_ratio():
    """A traced request keeps every span of its own, and only `step_ratio` of its step spans
    (what runs under a dropped step follows it out); an untraced one keeps none."""
    random.seed(7)
    sampler = StepSampler(ratio=1.0, step_ratio=0.1)

    def parent(sampled: bool):
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        ctx = SpanContext(trace_id=5, span_id=9, is_remote=True, trace_flags=flags)
        return trace.set_span_in_context(NonRecordingSpan(ctx))

    def kept(name: str, sampled: bool, n: int = 2000) -> int:
        return sum(
            sampler.should_sample(parent(sampled), 5, name).decision.is_sampled() for _ in range(n)
        )

    assert 120 <= kept("verifier.step", True) <= 280  # 10% of 2,000, give or take
    assert kept("verifier.verify", True) == kept("gateway.generate", True) == 2000
    assert kept("verifier.step", False) == kept("verifier.verify", False) == 0


def test_a_callers_traceparent_decides_nothing_at_the_gateway():
    """Finding 8 of the tenant-isolation review: a client's traceparent with the sampled flag
    had every request traced past `trace_sample_ratio`. At the gateway the ratio decides (the
    trace keeps the caller's id); behind it, every hop follows the gateway's decision."""
    edge, inside = StepSampler(0.0, 1.0, edge=True), StepSampler(0.0, 1.0)
    flags = TraceFlags(TraceFlags.SAMPLED)
    ctx = SpanContext(trace_id=5, span_id=9, is_remote=True, trace_flags=flags)
    sampled_parent = trace.set_span_in_context(NonRecordingSpan(ctx))
    assert not edge.should_sample(sampled_parent, 5, "gateway.generate").decision.is_sampled()
    assert inside.should_sample(sampled_parent, 5, "scheduler.submit").decision.is_sampled()
    everything = StepSampler(1.0, 1.0, edge=True)
    unsampled = SpanContext(trace_id=5, span_id=9, is_remote=True, trace_flags=TraceFlags(0))
    unsampled_parent = trace.set_span_in_context(NonRecordingSpan(unsampled))
    assert everything.should_sample(unsampled_parent, 5, "gateway.generate").decision.is_sampled()
    # Nor does the trace id the caller chose: one whose low bits are 0 passes any ratio
    # test on the id, but a draw of ours decides.
    random.seed(3)
    half = StepSampler(0.5, 1.0, edge=True)
    zero = SpanContext(trace_id=1 << 64, span_id=9, is_remote=True, trace_flags=flags)
    zero_parent = trace.set_span_in_context(NonRecordingSpan(zero))
    kept = sum(
        half.should_sample(zero_parent, 1 << 64, "gateway.generate").decision.is_sampled()
        for _ in range(2000)
    )
    assert 850 <= kept <= 1150  # half of 2,000, give or take


@pytest.mark.cluster
def test_the_standard_otel_variables_alone_send_traces(tmp_path, tiny_model_dir, monkeypatch):
    """No otlp_endpoint in the config: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT says where spans go,
    OTEL_TRACES_SAMPLER how many, OTEL_RESOURCE_ATTRIBUTES what they carry."""
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name, value in {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=otel-env-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }.items():
        monkeypatch.setenv(name, value)  # (the services inherit the test's environment)
    cluster = LocalCluster(cluster_config(tiny_model_dir), tmp_path)
    try:
        cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            generate(stub, request(prompt="hello", max_tokens=4))
        wait_until(
            lambda: {"specserve-gateway", "specserve-verifier"} <= {s for s, _ in collector.spans},
            "spans from the gateway and the verifier",
        )
    finally:
        cluster.stop()
        server.stop(0)
    assert collector.environments >= {"otel-env-test"}
