"""Starting any one service: settings, telemetry, build, serve until SIGTERM."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys

import prometheus_client

from . import telemetry, tls
from .probes import Probes
from .settings import SETTINGS_BY_SERVICE

log = logging.getLogger(__name__)


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
        server, on_stop = module.build(settings)
    except Exception as e:
        log.exception("%s failed to start", name)
        print(f"{name} failed to start: {e}", file=sys.stderr)
        return 1
    # What the build made (modules, the model, the tokenizer) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it (each walk paused
    # every open stream for as long as it took).
    gc.collect()
    gc.freeze()
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
