"""The gateway's core, behind both of its ports (grpc_api.py, http_api.py), knowing neither:
who calls (an API key), what they may ask, and a request's way in and out:

    validate + charge  ->  tokenize  ->  result cache | Submit  ->  stream of chunks

It takes the service contract's messages (generation.proto's `GenerateRequest`; the HTTP
port makes one of an OpenAI body), yields `GenerateResponse` chunks, and refuses with a typed
`GatewayError` (errors.py) that each port maps onto its own wire. Its parts have modules of
their own: quotas.py (tiers, rates, stream slots), prepare.py (validation, tokenizing),
result_cache.py, streaming.py (the output stream) and calls.py (a call's span and its end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

import grpc

from ..common import telemetry
from ..common.outage import REDIS_ERRORS
from ..common.pools import by_pool, pool_shares, versions
from ..common.settings import GatewaySettings
from ..store import RequestStore
from ..v1 import common_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from .audit import Audit, Call
from .calls import Calls
from .errors import Code, GatewayError
from .keys import ANONYMOUS, AuthError, KeyStore, Principal
from .prepare import Preparer
from .quotas import Quotas, authorize
from .result_cache import ResultCache, replayable
from .streaming import Streams
from .tails import Tails
from .validation import InvalidRequest, Limits, check_id

# Statuses of the scheduler's that the client can act on, passed through as they are.
PASS_THROUGH = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
)

Chunks = AsyncIterator[generation_pb2.GenerateResponse]


class Gateway:
    """The core, as coroutines on the server's event loop: an open stream holds no thread.
    Its output comes from `Tails` (a few blocking reads for every open stream); the
    scheduler is called on grpc.aio; Redis commands run on a bounded pool of threads
    (`max_workers`), tokenizing on one of its own (`tokenizer_workers`)."""

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer,
        store: RequestStore,
        scheduler: scheduler_pb2_grpc.SchedulerServiceStub,
        manifest: dict,
        loop: asyncio.AbstractEventLoop,
    ):
        self.settings, self.tokenizer, self.store = settings, tokenizer, store
        self.scheduler, self.manifest, self.loop = scheduler, manifest, loop
        # A token's own text (the logprobs of the HTTP API name tokens by it), remembered.
        self.token_text = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))
        self.limits = Limits(
            vocab_size=len(tokenizer),
            max_seq_len=settings.max_seq_len,
            max_tokens_limit=settings.max_tokens_limit,
            max_stop_strings=settings.max_stop_strings,
            max_stop_length=settings.max_stop_length,
        )
        self.pool = ThreadPoolExecutor(settings.max_workers, thread_name_prefix="gateway-io")
        self.tokenizing = ThreadPoolExecutor(
            settings.tokenizer_workers, thread_name_prefix="gateway-tokenize"
        )
        self.keys = KeyStore(store)
        self.quotas = Quotas(self.keys, self._io)
        self.preparer = Preparer(settings, tokenizer, self.limits, store)

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        self.results = ResultCache(store, settings.result_cache_ttl_seconds, decode, self._io)
        self.streams = Streams(Tails(store, loop), decode)
        audit = Audit(store, settings.audit_max_entries)
        self.calls = Calls(
            scheduler, settings.timeout_seconds, self.quotas, self.streams, audit, loop
        )

    async def _io(self, fn, *args, **kwargs):
        """Runs blocking work (Redis, a call to the scheduler) on the pool."""
        return await self.loop.run_in_executor(self.pool, partial(fn, *args, **kwargs))

    # --- who is calling -----------------------------------------------------------------------
    async def authenticate(self, authorization: str) -> Principal:
        """The caller from its `authorization` header's value, `Bearer <key>`:
        UNAUTHENTICATED without one. (Read from the call's headers: a call is authenticated
        before its request arrives.)"""
        if self.settings.auth == "off":
            return ANONYMOUS
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise GatewayError(
                Code.UNAUTHENTICATED,
                "an API key is required: `authorization: Bearer <key>` (gRPC metadata, or "
                "the HTTP header)",
            )
        try:
            return await self._io(self.keys.authenticate, key.strip())
        except AuthError as e:
            raise GatewayError(Code.UNAUTHENTICATED, str(e)) from None
        except REDIS_ERRORS:
            raise GatewayError(Code.UNAVAILABLE, "keys are unavailable; retry shortly") from None

    # --- Generate -----------------------------------------------------------------------------
    async def generate(
        self,
        call: Call,
        request: generation_pb2.GenerateRequest,
        who: Principal,
        deadline: float | None,
    ) -> Chunks:
        """Checks a call (begun with `calls.begin`), submits its new request, and gives the
        stream of its chunks (of an existing request's, from `resume_from`, to re-attach).
        `deadline`: the client's, in time.monotonic() seconds, if it set one. (One generator
        per stream, not a chain of them: with thousands of streams, each level would
        allocate per chunk.)"""
        call.who = who
        if request.HasField("resume_from"):
            return await self._resume(request, call)
        # Paid for before any work is done for it: the key's tier, then a request from its
        # rate and a stream slot; then tokenizing (on threads of its own), and then its
        # tokens. A request refused after that has cost its key a request.
        authorize(who, request)
        await self.quotas.open_stream(call, new_request=True)
        submit = await self._prepare(call, request, deadline)
        call.public_id = submit.request_id
        call.rid = submit.request_id = who.scoped(submit.request_id)
        name = common_pb2.PriorityClass.Name(submit.priority)
        call.priority = name.removeprefix("PRIORITY_CLASS_").lower()  # as the queues name it
        await self.quotas.charge(call, len(submit.prompt_ids), submit.max_tokens)
        cached = request.use_result_cache and replayable(submit)
        if cached and (hit := await self.results.lookup(submit)):
            return self.results.replay(call, *hit, list(submit.stop))
        await self._submit(call, submit, deadline)
        chunks = self.streams.stream(call, list(submit.stop))
        return self.results.caching(chunks, submit) if cached else chunks

    async def _prepare(
        self, call: Call, request, deadline: float | None
    ) -> scheduler_pb2.SubmitRequest:
        """The scheduler's request, validated and tokenized on the tokenizing threads."""
        with telemetry.tracer.start_as_current_span("gateway.validate", context=call.trace_ctx):
            try:
                return await self.loop.run_in_executor(
                    self.tokenizing,
                    partial(self.preparer.submit_request, request, _left(deadline), call.who),
                )
            except InvalidRequest as e:
                raise GatewayError(Code.INVALID_ARGUMENT, str(e)) from None

    async def _submit(
        self, call: Call, submit: scheduler_pb2.SubmitRequest, deadline: float | None
    ) -> None:
        """Submits the request; the scheduler's refusals a client can act on pass through."""
        configured = self.settings.timeout_seconds  # (or the client's deadline, if sooner)
        timeout = min(configured, _left(deadline) or configured)
        try:
            await asyncio.shield(self.calls.submit(call, submit, timeout))
        except grpc.RpcError as e:
            if e.code() in PASS_THROUGH:
                retry = dict(e.trailing_metadata() or ()).get("retry-after-ms")
                raise GatewayError(
                    Code[e.code().name], e.details(), int(retry) if retry else None
                ) from None
            raise GatewayError(
                Code.UNAVAILABLE, "the scheduler is unavailable; retry shortly"
            ) from None

    async def _resume(self, request, call: Call) -> Chunks:
        """Re-attach: the rest of an existing request's stream, from index resume_from."""
        start = request.resume_from
        if not request.request_id:
            raise GatewayError(Code.INVALID_ARGUMENT, "request_id: needed with resume_from")
        if start < 0:
            raise GatewayError(Code.INVALID_ARGUMENT, "resume_from: must be >= 0")
        _check_id(request.request_id)
        call.public_id, call.resumed = request.request_id, True
        call.rid = call.who.scoped(request.request_id)
        record = await self._record(call.rid, call.public_id)
        call.prompt_tokens = len(record.request.prompt_ids)
        call.priority = record.queue
        await self.quotas.open_stream(call, new_request=False)
        return self.streams.stream(call, list(record.request.stop), start)

    async def _record(self, rid: str, public_id: str):
        """The request's record; NOT_FOUND if it does not exist for this caller (another
        tenant's request is not told apart from none)."""
        try:
            record = await self._io(self.store.get, rid)
        except REDIS_ERRORS:
            raise GatewayError(Code.UNAVAILABLE, "request state is unavailable; retry") from None
        if record is None:
            raise GatewayError(
                Code.NOT_FOUND, f"request {public_id!r} does not exist (or has expired)"
            )
        return record

    # --- Cancel, model info -------------------------------------------------------------------
    async def cancel(self, who: Principal, request_id: str) -> bool:
        """Cancels the caller's request `request_id`; whether it was running."""
        if not request_id:
            raise GatewayError(Code.INVALID_ARGUMENT, "request_id: must not be empty")
        _check_id(request_id)
        rid = who.scoped(request_id)
        await self._record(rid, request_id)
        try:
            resp = await self.scheduler.Cancel(
                scheduler_pb2.SchedulerServiceCancelRequest(request_id=rid),
                timeout=self.settings.timeout_seconds,
            )
        except grpc.RpcError:
            raise GatewayError(Code.UNAVAILABLE, "the scheduler is unavailable; retry") from None
        return resp.cancelled

    async def model_info(self) -> generation_pb2.GetModelInfoResponse:
        """The served model, its limits, and the rollout pools that serve it now."""
        ref = self.settings.model
        try:
            verifiers, rollout = await self._io(
                lambda: (self.store.live_verifiers(), self.store.rollout())
            )
        except REDIS_ERRORS:
            raise GatewayError(Code.UNAVAILABLE, "the registry is unavailable; retry") from None
        return generation_pb2.GetModelInfoResponse(
            name=self.manifest.get("name", ref.label),
            version=self.manifest.get("version", ""),
            vocab_size=self.limits.vocab_size,
            max_seq_len=self.limits.max_seq_len,
            max_tokens_limit=self.limits.max_tokens_limit,
            sha256=self.manifest["sha256"],
            pools=served_pools(verifiers, rollout["canary_share"]),
        )


def served_pools(
    verifiers: list[dict[str, str]], canary_share: float
) -> list[generation_pb2.ServedPool]:
    """The rollout pools the registry's live verifiers serve, with their shares."""
    pools = by_pool(verifiers)
    shares = pool_shares(set(pools), canary_share)
    return [
        generation_pb2.ServedPool(
            pool=name,
            model_versions=versions(members),
            verifiers=len(members),
            share=shares.get(name, 0.0),
        )
        for name, members in pools.items()
    ]


def _check_id(request_id: str) -> None:
    """INVALID_ARGUMENT for an id no request can have (before it reaches Redis)."""
    try:
        check_id("request_id", request_id)
    except InvalidRequest as e:
        raise GatewayError(Code.INVALID_ARGUMENT, str(e)) from None


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (None for none)."""
    return None if deadline is None else deadline - time.monotonic()
