"""The gateway process's wiring (run as `specserve.gateway.server` by common/service.py):
the model's tokenizer, the store, the scheduler's channel, the core (core.py) and its two
ports, gRPC (grpc_api.py) and the OpenAI-compatible HTTP API (http_api.py, http_server.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging

from ..common.grpc_server import AioServer, retrying_channel
from ..common.settings import GatewaySettings
from ..engine import models
from ..store import RequestStore
from ..v1 import generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from .core import Gateway
from .grpc_api import GenerationService, handler
from .http_api import OpenAIHttp
from .http_server import HttpServer
from .keys import KeyStore

log = logging.getLogger(__name__)

# A young collection runs once this many more objects were made than freed (Python's default:
# 700). What an open stream allocates for a wait lives until its next token, seconds away:
# at 700, thousands of streams had it collected, promoted through every generation and
# walked again, and each collection paused every stream (2,000 streams: young and middle
# collections of up to 30 ms, full ones of 70 ms). At 50,000 it is mostly freed before any
# collection runs; garbage in cycles still counts towards the next one, so it stays bounded.
GC_YOUNG_THRESHOLD = 50_000


def build(settings: GatewaySettings):
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    path, manifest = models.resolve(settings.model, settings.model_cache_dir)
    manifest = {**manifest, "sha256": models.fingerprint(path, manifest)}
    tokenizer = models.load_tokenizer(path)
    store = RequestStore.connect(settings)
    store.wait_reachable()
    if settings.api_keys_file:
        seeded = KeyStore(store).seed(settings.api_keys_file, settings.tiers)
        log.info("api keys seeded", extra={"keys": seeded})
    if settings.auth == "off":
        log.warning("authentication is off: every caller is one anonymous tenant, no quotas")
    name = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
    server = AioServer(
        settings.host,
        settings.port,
        [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name],
        max_concurrent_rpcs=settings.max_concurrent_rpcs,
        public=True,
    )

    async def scheduler_channel():  # (made on the server's loop, which uses it)
        return retrying_channel(settings.scheduler_address, name, aio=True)

    scheduler = scheduler_pb2_grpc.SchedulerServiceStub(server.run(scheduler_channel()))
    core = Gateway(settings, tokenizer, store, scheduler, manifest, server.loop)
    asyncio.run_coroutine_threadsafe(core.quotas.keep_slots_alive(), server.loop)
    server.grpc.add_generic_rpc_handlers((handler(GenerationService(core)),))
    server.start()
    if settings.http_port is not None:
        names = [manifest.get("name", settings.model.label), *settings.http_model_aliases]
        api = OpenAIHttp(core, names, settings.http_max_body_bytes, settings.max_concurrent_rpcs)
        http = HttpServer(api, lambda: server.serving)
        server.ports["http"] = server.run(http.start(settings.host, settings.http_port))
        server.drains.append(http.stop)
    server.watch({"redis reachable": store.ping})
    log.info(
        "gateway ready",
        extra={"port": server.port, **server.ports, "model": settings.model.label},
    )

    def on_stop() -> None:
        core.calls.draining = True

    return server, on_stop
