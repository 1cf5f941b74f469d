"""Drafter gRPC service. The model loads and health answers; drafting itself is not built yet,
so Speculate answers UNIMPLEMENTED and verifiers decode plainly."""

from __future__ import annotations

import logging

import grpc
import torch

from ..common import models
from ..common.grpc_server import Server
from ..common.settings import DrafterSettings, ModelRef
from ..v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def Speculate(self, request_iterator, context):
        context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "drafting is not available in this version; verifiers decode plainly",
        )


def build(settings: DrafterSettings):
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    label = "ngram"
    if settings.proposer == "draft_model":
        ref = (
            ModelRef(path=settings.draft_model_path)
            if settings.draft_model_path
            else settings.draft_model
        )
        path, _ = models.resolve(ref, settings.model_cache_dir)
        models.load_model(path, settings.device, settings.dtype)
        label = ref.label
    server = Server(
        settings.host, settings.port, [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name]
    )
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterService(), server.grpc)
    server.start()
    server.set_serving(True)
    log.info(
        "drafter ready", extra={"port": server.port, "proposer": settings.proposer, "model": label}
    )
    return server, lambda: None
