"""Structured logs and OpenTelemetry tracing setup, one call per process."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider


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


def setup(service: str, log_level: str, otlp_endpoint: str | None = None) -> None:
    """Configures JSON logging to stderr and a tracer provider named after the service."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level)
    resource = Resource.create(
        {"service.name": f"specserve-{service}", "service.instance.id": str(os.getpid())}
    )
    provider = TracerProvider(resource=resource)
    if otlp_endpoint:
        logging.getLogger(__name__).warning(
            "otlp_endpoint is set but no OTLP exporter is installed; spans are not exported",
            extra={"endpoint": otlp_endpoint},
        )
    trace.set_tracer_provider(provider)
