"""Starting any one service: settings, telemetry, build, serve until SIGTERM."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future

import prometheus_client

from . import telemetry, tls
from .probes import Probes
from .settings import SETTINGS_BY_SERVICE

log = logging.getLogger(__name__)

GC_PAUSE = prometheus_client.Histogram(
    "specserve_gc_pause_seconds",
    "How long each collection of the cyclic garbage collector held the interpreter (every "
    "thread of the process waits), by generation (2: a full collection).",
    ["generation"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1),
)


def watch_gc_pauses() -> None:
    """Times every collection into GC_PAUSE."""
    started = [0.0]
    by_generation = [GC_PAUSE.labels(str(g)) for g in range(3)]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)


def in_own_thread(fn, *args):
    """fn(*args) on a thread that ends with it: its result, or its exception raised here.

    A service's build (the model's load, quantisation, warm-up and timing) runs there rather
    than on the main thread. OpenMP (torch's CPU threads) keeps a team of worker threads for
    every thread that has run a parallel region, for that thread's life. The main thread's
    team beside the engine thread's makes more OpenMP threads than cores, and libgomp then
    lets idle workers spin only briefly before they sleep: every parallel op of a step waited
    for its workers to wake, and the default target decoded at 18.5 tokens/s against 28-30
    with the model's work on one thread (2 cores, int4). A thread that ends takes its team
    with it, so the engine's is the process's only one."""
    outcome: Future = Future()

    def run() -> None:
        try:
            outcome.set_result(fn(*args))
        except BaseException as e:  # (raised on the caller's thread)
            outcome.set_exception(e)

    thread = threading.Thread(target=run, name="build", daemon=True)
    thread.start()
    thread.join()
    return outcome.result()


def run_service(name: str, config_path: str | None, port: int | None = None) -> int:
    settings = SETTINGS_BY_SERVICE[name].load(config_path, port=port)
    telemetry.setup(
        name,
        settings.log_level,
        settings.otlp_endpoint,
        settings.trace_sample_ratio,
        settings.trace_step_sample_ratio,
    )
    tls.configure(settings)
    metrics = ""
    if settings.metrics_port is not None:
        http, _ = prometheus_client.start_http_server(settings.metrics_port, addr=settings.host)
        metrics = f" metrics {http.server_port}"
    # The kubelet's probes first: bound before the model loads or Redis answers.
    probes = (
        Probes(settings.host, settings.health_port) if settings.health_port is not None else None
    )
    module = importlib.import_module(f"specserve.{name}.server")
    try:
        server, on_stop = in_own_thread(module.build, settings)
    except Exception as e:
        log.exception("%s failed to start", name)
        print(f"{name} failed to start: {e}", file=sys.stderr)
        return 1
    # What the build made (modules, the model, the tokenizer) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it (each walk paused
    # every open stream for as long as it took).
    gc.collect()
    gc.freeze()
    watch_gc_pauses()
    if probes is not None:
        probes.attach(server)
        server.ports["health"] = probes.port
    # The bound ports, on a line of their own, for whoever started us with port 0.
    more = "".join(f" {kind} {port}" for kind, port in server.ports.items())
    print(f"SPECSERVE_READY {name} {server.port}{metrics}{more}", flush=True)
    server.run_until_signal(settings.drain_seconds, on_stop)
    if probes is not None:
        probes.stop()
    telemetry.shutdown()
    if server.failure:
        print(f"{name} stopped: {server.failure}", file=sys.stderr, flush=True)
        # Drained and deregistered already; a thread may still wait in a lost group's
        # exchange, which the interpreter's shutdown could wait on in turn.
        os._exit(1)
    return 0
