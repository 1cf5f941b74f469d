"""Every service answers grpc.health.v1 and server reflection (grpcurl needs no proto files)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from helpers import wait_until

pytestmark = pytest.mark.cluster  # every test here runs a cluster

SERVICES = {
    "gateway": "specserve.v1.GenerationService",
    "scheduler": "specserve.v1.SchedulerService",
    "verifier": "specserve.v1.VerifierService",
    "drafter": "specserve.v1.DrafterService",
}


@pytest.mark.parametrize("name", list(SERVICES))
def test_health_and_reflection(tiny_cluster, name):
    with grpc.insecure_channel(tiny_cluster.procs[name].address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICES[name]):
            # (Readiness comes from the health loop's first pass, which may follow the ready
            # line by a moment.)
            def serving(service=service) -> bool:
                ask = health_pb2.HealthCheckRequest(service=service)
                return health.Check(ask, timeout=5).status == health_pb2.HealthCheckResponse.SERVING

            wait_until(serving, f"{name} {service or 'overall'} SERVING", 30)
        db = ProtoReflectionDescriptorDatabase(channel)
        listed = set(db.get_services())
        assert {SERVICES[name], "grpc.health.v1.Health"} <= listed
        methods = DescriptorPool(db).FindServiceByName(SERVICES[name]).methods
        assert len(methods) >= 1
