"""The result cache: a deterministic request's whole output, kept in Redis under a key of
what determines it (and the model version that produced it), and replayed as a stream.

A request asks for it with `use_result_cache`; only a replayable one (greedy, or sampled
with a seed; no log-probabilities) is looked up or stored. A hit is replayed only where a
version that would serve the request now produced it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from google.protobuf import json_format

from ..common.outage import REDIS_ERRORS
from ..common.pools import by_pool, choose_pool, versions
from ..store import RequestStore
from ..v1 import common_pb2, generation_pb2, scheduler_pb2
from .audit import Call
from .text import IncrementalDetokenizer, StopTrimmer

log = logging.getLogger(__name__)


class ResultCache:
    """The cache in `store`; entries live `ttl_seconds`. `decode` is the tokenizer's (ids to
    text); `io` runs blocking work (Redis) off the event loop."""

    def __init__(
        self,
        store: RequestStore,
        ttl_seconds: float,
        decode: Callable[[list[int]], str],
        io: Callable[..., Awaitable],
    ):
        self.store, self.ttl_seconds, self.decode, self._io = store, ttl_seconds, decode, io

    async def lookup(self, submit: scheduler_pb2.SubmitRequest) -> tuple[list[int], dict] | None:
        """A result (its token ids, its final info) that a version which would serve this
        request now produced, or None."""
        return await self._io(self._cached_result, submit)

    def _cached_result(self, submit: scheduler_pb2.SubmitRequest):
        try:
            verifiers, share = self.store.live_verifiers(), self.store.rollout()["canary_share"]
            for version in serving_versions(verifiers, share, submit.request_id):
                if hit := self.store.cached_result(result_cache_key(submit, version)):
                    return hit
            return None
        except REDIS_ERRORS:
            log.warning("result cache unavailable")
            return None

    def _cache_result(self, key: str, ids: list[int], final) -> None:
        info = json_format.MessageToDict(final, preserving_proto_field_name=True)
        try:
            self.store.cache_result(key, ids, info, self.ttl_seconds)
        except REDIS_ERRORS:
            log.warning("result cache unavailable")

    async def caching(
        self, chunks: AsyncIterator[generation_pb2.GenerateResponse], submit
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The chunks as they go, with the result cached when its final chunk comes."""
        ids = []
        async for chunk in chunks:
            ids.extend(chunk.token_ids)
            final = chunk.final if chunk.HasField("final") else None
            if final and final.model_version:  # keyed on what produced it
                key = result_cache_key(submit, final.model_version)
                await self._io(self._cache_result, key, ids, final)
            yield chunk

    async def replay(
        self, call: Call, ids: list[int], final: dict, stop: list[str]
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """A cached result as a stream: all its tokens, then the final chunk."""
        rid = call.public_id
        detok = IncrementalDetokenizer(self.decode)
        trimmer = StopTrimmer(stop)
        yield generation_pb2.GenerateResponse(
            request_id=rid,
            text=trimmer.push(detok.add(ids)),
            token_ids=ids,
            first_index=0,
            model_version=final.get("model_version", ""),
        )
        info = json_format.ParseDict(final, generation_pb2.FinalInfo(), ignore_unknown_fields=True)
        info.timings.Clear()  # nothing ran
        info.cached = True
        call.emitted, call.finish = len(ids), common_pb2.FinishReason.Name(info.finish_reason)
        yield generation_pb2.GenerateResponse(
            request_id=rid,
            text=trimmer.push(detok.flush()) + trimmer.flush(),
            first_index=len(ids),
            final=info,
        )


def serving_versions(verifiers: list[dict[str, str]], canary_share: float, rid: str) -> list[str]:
    """The model versions that would serve a new request now: those of the pool the share
    sends it to (as the scheduler chooses), from the registry's live verifiers."""
    pools = by_pool(verifiers)
    if not pools:
        return []
    return versions(pools.get(choose_pool(rid, canary_share, set(pools)), []))


def replayable(submit: scheduler_pb2.SubmitRequest) -> bool:
    """Whether a request is deterministic (greedy, or sampling with a seed), so a result
    cache entry may answer it; unseeded sampling never is. (Nor is one that asks for
    log-probabilities: the cache keeps token ids alone.)"""
    if submit.logprobs:
        return False
    return submit.sampling.temperature <= 0 or submit.sampling.HasField("seed")


def result_cache_key(submit: scheduler_pb2.SubmitRequest, model_version: str) -> str:
    """The result cache key of a replayable request. `model_version` is the served version
    (models.served_version: weights, dtype, device), so a result replays only where the same
    version would serve the request again; its prefix scope (the tenant, under
    `prefix_cache_scope: tenant`), so only to the tenant whose request made it. Speculation
    does not change a greedy output, so it is not part of a greedy key."""
    sampling = submit.sampling
    parts = {
        "scope": submit.prefix_scope,
        "model": model_version,
        "prompt": list(submit.prompt_ids),
        "max_tokens": submit.max_tokens,
        "stop": list(submit.stop),
        "grammar": json_format.MessageToDict(submit.grammar),
    }
    if sampling.temperature > 0:
        parts["sampling"] = json_format.MessageToDict(sampling)
        parts["speculation"] = json_format.MessageToDict(submit.speculation)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
