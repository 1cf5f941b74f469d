"""What the kubelet asks a process: grpc.health.v1 in plaintext on `health_port`, for its own
gRPC probes (they cannot present the cluster's client certificate, which the service port
asks for). Bound at the process's start, before the model loads or Redis answers:

- `liveness`: SERVING once the service is built, while its readiness loop (`_Serving.watch`)
  beats, which it does while the process's own liveness checks pass (the gateway's event
  loop answers; the verifier's engine steps and succeeds), and through a drain. Nothing
  that depends on Redis or another service: an outage elsewhere restarts nothing;
- `readiness` (and ""): the service's readiness, as its own port reports it (Redis
  reachable, not draining, ...).
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LIVENESS_SECONDS = 30.0  # no beat of the readiness loop for this long: liveness fails
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Probes(health_pb2_grpc.HealthServicer):
    """The probe port. `attach` gives it the built service's server (`_Serving`)."""

    def __init__(self, host: str, port: int, liveness_seconds: float = LIVENESS_SECONDS):
        self.server = None  # the service's, once built
        self.liveness_seconds = liveness_seconds
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self, self._grpc)
        self.port = self._grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"cannot bind the health port {host}:{port}")
        self._grpc.start()

    def attach(self, server) -> None:
        self.server = server

    def status(self, service: str) -> int | None:
        """The status of `service`, or None for a name it does not know."""
        server = self.server
        if service == "liveness":  # (a draining process is alive: its loop has stopped)
            if server is None or server.last_beat is None:
                return NOT_SERVING  # not started yet
            recent = time.monotonic() - server.last_beat < self.liveness_seconds
            return SERVING if recent or server.stopped.is_set() else NOT_SERVING
        if service in ("", "readiness"):
            return SERVING if server is not None and server.serving else NOT_SERVING
        return None

    def Check(self, request, context):
        status = self.status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no such service: {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def stop(self) -> None:
        self._grpc.stop(0)
