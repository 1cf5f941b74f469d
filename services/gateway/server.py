"""Gateway gRPC service: the public Generation API."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

import grpc
from google.protobuf import json_format
from opentelemetry import trace

from ..common import logprob_format, prefix, telemetry
from ..common.grpc_server import AioServer, retrying_channel
from ..common.outage import REDIS_ERRORS
from ..common.pools import by_pool, choose_pool, pool_shares, versions
from ..common.settings import GatewaySettings
from ..engine import models
from ..speculation import grammar
from ..store import RequestStore
from ..v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from . import metrics, tools
from .audit import Audit, Call
from .http_server import OpenAIHttp
from .keys import (
    ANONYMOUS,
    STREAM_TOUCH_SECONDS,
    AuthError,
    KeyStore,
    Principal,
    QuotaExceeded,
    stream_id,
)
from .tails import Tails
from .text import IncrementalDetokenizer, StopTrimmer
from .validation import (
    InvalidRequest,
    Limits,
    check_fits,
    check_id,
    check_prompt_length,
    find_invalid_utf8,
    validate,
)

log = logging.getLogger(__name__)

REDIS_OUTAGE_SECONDS = 30.0  # a stream waits this long for Redis before it gives up
NO_DEADLINE_SECONDS = 10 * 365 * 86400  # a client deadline further out than this is none
REGISTRY_TTL_SECONDS = 1.0  # how long the verifiers' largest KV budget is reused
# A young collection runs once this many more objects were made than freed (Python's default:
# 700). What an open stream allocates for a wait lives until its next token, seconds away:
# at 700, thousands of streams had it collected, promoted through every generation and
# walked again, and each collection paused every stream (2,000 streams: young and middle
# collections of up to 30 ms, full ones of 70 ms). At 50,000 it is mostly freed before any
# collection runs; garbage in cycles still counts towards the next one, so it stays bounded.
GC_YOUNG_THRESHOLD = 50_000
# Statuses of the scheduler's that the client can act on, passed through as they are.
PASS_THROUGH = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
)


class _BadBytes:
    """Stands in for a request whose bytes do not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, field: str):
        self.field = field


def _deserialize(raw: bytes):
    try:
        return generation_pb2.GenerateRequest.FromString(raw)
    except Exception:
        try:
            field = find_invalid_utf8(raw)
        except Exception:
            field = None
        return _BadBytes(field or "request")


class GenerationService(generation_pb2_grpc.GenerationServiceServicer):
    """The public API, as coroutines on the server's event loop: an open stream holds no
    thread. Its output comes from `Tails` (a few blocking reads for every open stream); the
    scheduler is called on grpc.aio; Redis commands and tokenizing run on a bounded pool of
    threads (`max_workers`)."""

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer,
        store: RequestStore,
        scheduler: scheduler_pb2_grpc.SchedulerServiceStub,
        manifest: dict,
        loop: asyncio.AbstractEventLoop,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        # A token's own text (the logprobs of the HTTP API name tokens by it), remembered.
        self.token_text = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))
        self.grammars = grammar.Grammars(tokenizer, len(tokenizer))
        self.store = store
        self.scheduler = scheduler
        self.manifest = manifest
        self.limits = Limits(
            vocab_size=len(tokenizer),
            max_seq_len=settings.max_seq_len,
            max_tokens_limit=settings.max_tokens_limit,
            max_stop_strings=settings.max_stop_strings,
            max_stop_length=settings.max_stop_length,
        )
        self._largest: tuple[float, tuple[int, int, int] | None] = (0.0, None)
        self.keys = KeyStore(store.r)
        self.draining = False  # set on SIGTERM: streams cut by the drain are not cancellations
        self.audit = Audit(store.r, settings.audit_max_entries)
        self.loop = loop
        self.pool = ThreadPoolExecutor(settings.max_workers, thread_name_prefix="gateway-io")
        self.tokenizing = ThreadPoolExecutor(
            settings.tokenizer_workers, thread_name_prefix="gateway-tokenize"
        )
        self.settling = ThreadPoolExecutor(1, thread_name_prefix="gateway-settle")
        self.tails = Tails(store, loop)
        self._cancels: set[asyncio.Task] = set()  # cancels of requests whose client left
        self._submits: set[asyncio.Future] = set()  # Submits on their way to the scheduler
        # open streams by request id (as stored): the calls (by id()) reading each
        self._streaming: dict[str, set[int]] = {}
        self._slots: dict[str, str] = {}  # open streams' quota slots: stream id -> key id
        self._awaiting: dict[str, int] = {}  # calls whose request has not arrived, by key id

    async def _io(self, fn, *args, **kwargs):
        """Runs blocking work (Redis, the tokenizer, a call to the scheduler) on the pool."""
        return await self.loop.run_in_executor(self.pool, partial(fn, *args, **kwargs))

    @contextlib.contextmanager
    def awaiting_request(self, who: Principal) -> Iterator[None]:
        """Counts a call, authenticated from its headers, while its request message (or HTTP
        body) is on its way: a key has at most its `concurrent_streams` of those on this
        gateway (QuotaExceeded past that), so headers sent without a request hold at most
        a key's own share of the server's calls, for at most first_message_timeout_seconds."""
        limit = who.limits.concurrent_streams if who.limits is not None else None
        waiting = self._awaiting.get(who.key_id, 0)
        if limit is not None and waiting >= limit:
            raise QuotaExceeded(
                f"this key has {waiting} calls on this gateway whose request has not arrived "
                f"(its cap: {limit} concurrent streams); send the request with the headers",
                retry_after_ms=1000,
            )
        self._awaiting[who.key_id] = waiting + 1
        metrics.AWAITING_REQUEST.inc()
        try:
            yield
        finally:
            metrics.AWAITING_REQUEST.dec()
            if (left := self._awaiting.pop(who.key_id) - 1) > 0:
                self._awaiting[who.key_id] = left

    async def receive(self, requests, context) -> tuple[Principal, object]:
        """A gRPC call's caller, from its headers, then its one request message, which must
        come within first_message_timeout_seconds (`awaiting_request` meanwhile). A call
        refused here is counted and audited as a refused Generate is."""
        timeout = self.settings.first_message_timeout_seconds
        who = ANONYMOUS
        try:
            who = await self.authenticate(context)
            try:
                with self.awaiting_request(who):
                    request = await asyncio.wait_for(anext(requests, None), timeout)
            except QuotaExceeded as e:
                context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no request message arrived within {timeout:g}s of the call's headers",
                )
            if request is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
            return who, request
        except grpc.aio.AbortError:
            code = context.code()
            self.refused(Call(peer=context.peer(), who=who), getattr(code, "name", "CANCELLED"))
            raise

    # --- Generate ---------------------------------------------------------------------------
    async def Generate(self, request, context, who: Principal | None = None):
        """`who`: the caller, when the key was checked before the request arrived."""
        call = Call(peer=context.peer(), protocol=getattr(context, "protocol", "grpc"))
        call.span = telemetry.tracer.start_span(
            "gateway.generate", context=telemetry.extract(context.invocation_metadata())
        )
        call.trace_ctx = trace.set_span_in_context(call.span)
        context.add_done_callback(lambda ctx: self._ended(call, ctx))
        async for chunk in await self._begin(request, context, call, who):
            yield chunk

    async def _begin(self, request, context, call: Call, who: Principal | None) -> AsyncIterator:
        """Checks the call, submits a new request, and gives the stream of its chunks. (One
        generator per stream, not a chain of them: with thousands of streams, each level
        would allocate per chunk.)"""
        if isinstance(request, _BadBytes):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.field}: is not valid UTF-8 (or the message is malformed)",
            )
        call.who = who or await self.authenticate(context)
        if request.HasField("resume_from"):
            return await self._resume(request, context, call)
        # Paid for before any work is done for it: the key's tier, then a request from its
        # rate and a stream slot; then tokenizing (on threads of its own), and then its
        # tokens. A request refused after that has cost its key a request.
        await self._authorize(call.who, request, context)
        await self._open_stream(call, context, new_request=True)
        with telemetry.tracer.start_as_current_span("gateway.validate", context=call.trace_ctx):
            try:
                submit = await self.loop.run_in_executor(
                    self.tokenizing,
                    partial(self._to_submit, request, context.time_remaining(), call.who),
                )
            except InvalidRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        call.public_id = submit.request_id
        call.rid = submit.request_id = call.who.scoped(submit.request_id)
        name = common_pb2.PriorityClass.Name(submit.priority)
        call.priority = name.removeprefix("PRIORITY_CLASS_").lower()  # as the queues name it
        await self._charge(call, len(submit.prompt_ids), submit.max_tokens, context)
        cached = request.use_result_cache and replayable(submit)
        if cached and (hit := await self._io(self._cached_result, submit)):
            return self._replay(call, *hit, list(submit.stop))
        # Waits out a restarting scheduler (within the deadline); Submit is idempotent. It is
        # not cut short when the client leaves: the request it may create is cancelled once
        # it is known to exist (`_ended`), never left to run for nobody.
        call.submitted = asyncio.ensure_future(
            self.scheduler.Submit(
                submit,
                timeout=self._timeout(context),
                wait_for_ready=True,
                metadata=telemetry.inject(call.trace_ctx),
            )
        )
        self._submits.add(call.submitted)
        call.submitted.add_done_callback(self._submits.discard)
        call.submitted.add_done_callback(_settled)
        try:
            await asyncio.shield(call.submitted)
        except grpc.RpcError as e:
            if e.code() in PASS_THROUGH:
                context.set_trailing_metadata(e.trailing_metadata() or ())
                await context.abort(e.code(), e.details())
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the scheduler is unavailable; retry shortly"
            )
        chunks = self._stream(call, list(submit.stop), context)
        return self._caching(chunks, submit) if cached else chunks

    async def _caching(self, chunks: AsyncIterator, submit: scheduler_pb2.SubmitRequest):
        """The chunks as they go, with the result cached when its final chunk comes."""
        ids = []
        async for chunk in chunks:
            ids.extend(chunk.token_ids)
            final = chunk.final if chunk.HasField("final") else None
            if final and final.model_version:  # keyed on what produced it
                key = result_cache_key(submit, final.model_version)
                await self._io(self._cache_result, key, ids, final)
            yield chunk

    # --- who is calling, and what they may do -------------------------------------------------
    async def authenticate(self, context) -> Principal:
        """The caller from its `authorization: Bearer <key>`; UNAUTHENTICATED without one.
        (Read from the call's headers: a call is authenticated before its request arrives.)"""
        if self.settings.auth == "off":
            return ANONYMOUS
        header = dict(context.invocation_metadata()).get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "an API key is required: `authorization: Bearer <key>` (gRPC metadata, or "
                "the HTTP header)",
            )
        try:
            return await self._io(self.keys.authenticate, key.strip())
        except AuthError as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except REDIS_ERRORS:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "keys are unavailable; retry shortly")

    @staticmethod
    async def _authorize(who: Principal, request, context) -> None:
        """PERMISSION_DENIED for what the key's tier does not allow (read from the request as
        sent: a max_tokens left unset is within the cap)."""
        limits = who.limits
        if limits is None:
            return
        if request.priority == common_pb2.PRIORITY_CLASS_BATCH and not limits.batch:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"priority: this key's tier ({who.tier}) may not use the batch class",
            )
        if request.max_tokens > limits.max_tokens:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"max_tokens: {request.max_tokens} is above this key's cap of {limits.max_tokens}",
            )

    async def _open_stream(self, call: Call, context, new_request: bool) -> None:
        """Takes a stream slot (and, for a new request, one request of its rate)."""
        sid = stream_id()
        await self._quota(context, self.keys.admit, call.who, sid, new_request=new_request)
        call.stream = sid
        if call.who.limits is not None:
            self._slots[sid] = call.who.key_id

    async def _charge(self, call: Call, prompt_tokens: int, max_tokens: int, context) -> None:
        """Takes a new request's tokens (prompt + max_tokens) from its key's rate; what it
        does not generate goes back when it ends."""
        await self._quota(context, self.keys.take_tokens, call.who, prompt_tokens + max_tokens)
        call.prompt_tokens, call.max_tokens = prompt_tokens, max_tokens

    async def _quota(self, context, take, *args, **kwargs) -> None:
        """A quota's `take`, on the pool: RESOURCE_EXHAUSTED (with when to retry) if used up."""
        try:
            await self._io(take, *args, **kwargs)
        except QuotaExceeded as e:
            context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except REDIS_ERRORS:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "quotas are unavailable; retry shortly"
            )

    def _ended(self, call: Call, context) -> None:
        """When the RPC ends, however (on the event loop): the metrics; then, on the pool,
        the stream slot and unused tokens go back, a request whose client left before the
        end is cancelled, and the call is audited."""
        code = context.code() if hasattr(context, "code") else None
        status = call.finish or (code.name if code else "CANCELLED")
        if context.cancelled() and not call.finish:
            status = "CANCELLED"
        record = call.record(status)
        pool = call.pool or "none"
        metrics.REQUESTS.labels(call.priority or "unknown", status, pool).inc()
        if call.first_token_at and not call.resumed:
            metrics.TTFT.labels(call.priority, pool).observe(call.first_token_at - call.started)
        if call.emitted > 1 and not call.resumed:
            per_token = (time.monotonic() - call.first_token_at) / (call.emitted - 1)
            metrics.TPOT.labels(call.priority, pool).observe(per_token)
        if call.streaming:
            metrics.OPEN_STREAMS.dec()
        self._slots.pop(call.stream, None)
        call.span.set_attributes({k: v for k, v in record.items() if k != "client"})
        call.span.end()
        reattaches = call.protocol == "grpc" and (self.draining or call.told_to_reattach)
        if not call.finish and not reattaches:
            # Nobody will read the rest. (A gRPC client cut by a drain, or told to re-attach
            # after a Redis outage, re-attaches; an HTTP client cannot.)
            submitted = call.submitted
            if submitted is not None and not submitted.done():  # (it may yet create one)
                submitted.add_done_callback(lambda f: self._cancel_soon(call, f))
            elif call.streaming or submitted is not None:
                self._cancel_soon(call, submitted)
        self._settle_soon(call, record)

    def _cancel_soon(self, call: Call, submitted: asyncio.Future | None) -> None:
        """Cancels the request of a call whose client left, if its Submit (when given) created
        it and no other call on this gateway streams it (a client's retry that attached
        meanwhile). The call's own stream may not have closed yet: the RPC's done callback can
        run before its generator's `finally`."""
        if submitted is not None and (submitted.cancelled() or submitted.exception()):
            return
        if self._streaming.get(call.rid, set()) - {id(call)}:
            return
        task = self.loop.create_task(self._cancel_quietly(call.rid))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def keep_slots_alive(self) -> None:
        """Marks every open stream's quota slot alive every STREAM_TOUCH_SECONDS, so that a
        stream open for longer than STREAM_MAX_AGE_MS (long reasoning) still counts against
        its key's cap; a slot of a gateway that died still ages out."""
        while True:
            await asyncio.sleep(STREAM_TOUCH_SECONDS)
            try:
                await self._io(self.keys.touch, [(k, s) for s, k in self._slots.items()])
            except REDIS_ERRORS:
                log.warning("stream slots not refreshed; tried again next time")

    def refused(self, call: Call, status: str) -> None:
        """A call refused before it reached its method (gRPC: at its headers, or while its
        request did not come; HTTP: a wrong key, a bad body): counted and audited as
        `_ended` does a refused Generate."""
        metrics.REQUESTS.labels("unknown", status, "none").inc()
        self._settle_soon(call, call.record(status))

    def _settle_soon(self, call: Call, record: dict) -> None:
        """The quota release and the audit record, in order, on one thread of their own:
        thousands of streams ending at once wake one thread, not the whole pool at once
        (whose threads then take turns at the interpreter lock with the event loop)."""
        try:
            self.settling.submit(self._settle, call, record)
        except RuntimeError:  # the process is exiting (the pool is shut): settle it here
            self._settle(call, record)

    def _settle(self, call: Call, record: dict) -> None:
        if call.stream:
            unused = 0 if call.resumed else call.max_tokens - call.emitted
            try:
                self.keys.release(call.who, call.stream, unused)
            except REDIS_ERRORS:
                log.warning("quota release failed; the slot ages out")
        self.audit.write(record)

    # --- result cache -----------------------------------------------------------------------
    def _cached_result(self, submit: scheduler_pb2.SubmitRequest):
        """A result that a version which would serve this request now produced, or None."""
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
            self.store.cache_result(key, ids, info, self.settings.result_cache_ttl_seconds)
        except REDIS_ERRORS:
            log.warning("result cache unavailable")

    async def _replay(self, call: Call, ids: list[int], final: dict, stop: list[str]):
        """A cached result as a stream: all its tokens, then the final chunk."""
        rid = call.public_id
        detok = IncrementalDetokenizer(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        )
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

    def _timeout(self, context) -> float:  # (callable off the loop: it reads only)
        """An internal call's deadline: the configured one, or the client's if sooner."""
        remaining = context.time_remaining()
        return min(self.settings.timeout_seconds, remaining or self.settings.timeout_seconds)

    def _largest_verifier(self) -> tuple[int, int, int] | None:
        fetched, largest = self._largest
        if time.monotonic() - fetched > REGISTRY_TTL_SECONDS:
            try:
                largest = self.store.largest_verifier()
            except REDIS_ERRORS:
                largest = None  # the scheduler queues it; admission still never overcommits
            self._largest = (time.monotonic(), largest)
        return largest

    async def _resume(self, request, context, call: Call):
        """Re-attach: the rest of an existing request's stream, from index resume_from."""
        start = request.resume_from
        if not request.request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id: needed with resume_from"
            )
        if start < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resume_from: must be >= 0")
        await self._check_id(request.request_id, context)
        call.public_id, call.resumed = request.request_id, True
        call.rid = call.who.scoped(request.request_id)
        record = await self._record(call.rid, call.public_id, context)
        call.prompt_tokens = len(record.spec.get("prompt_ids", []))
        call.priority = record.queue
        await self._open_stream(call, context, new_request=False)
        return self._stream(call, list(record.spec.get("stop", [])), context, start)

    @staticmethod
    async def _check_id(request_id: str, context) -> None:
        """INVALID_ARGUMENT for an id no request can have (before it reaches Redis)."""
        try:
            check_id("request_id", request_id)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _record(self, rid: str, public_id: str, context):
        """The request's record; NOT_FOUND if it does not exist for this caller (another
        tenant's request is not told apart from none)."""
        try:
            record = await self._io(self.store.get, rid)
        except REDIS_ERRORS:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "request state is unavailable; retry")
        if record is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"request {public_id!r} does not exist (or has expired)"
            )
        return record

    def _to_submit(
        self, req, remaining: float | None, who: Principal
    ) -> scheduler_pb2.SubmitRequest:
        """The scheduler's request (validated, tokenized), on the pool; `remaining` is the
        client's deadline in seconds (huge, not None, when it set none)."""
        validate(req, self.limits)
        which = req.WhichOneof("input")
        if which == "prompt_ids":
            ids = list(req.prompt_ids.ids)
        elif which == "prompt":
            ids = self.tokenizer(req.prompt).input_ids
        else:
            if req.tools and not tools.supported(self.tokenizer.chat_template):
                raise InvalidRequest(
                    "tools", "this model's chat template has no tool calls in a known format"
                )
            parameters = self._tool_parameters(req)
            text = self.tokenizer.apply_chat_template(
                tools.chat_messages(req.messages.messages),
                tools=tools.template_tools(req.tools, parameters),
                add_generation_prompt=True,
                tokenize=False,
            )
            ids = self.tokenizer(text).input_ids
        if not ids:
            raise InvalidRequest(which, "tokenizes to no tokens")
        check_prompt_length(len(ids), self.limits)
        constraint, field = req.grammar, "grammar"
        if which == "messages" and (required := self._tool_grammar(req, parameters)):
            constraint, field = required, "tool_choice"
        self._check_grammar(constraint, field)
        default = self.limits.default_max_tokens
        if who.limits is not None:
            default = min(default, who.limits.max_tokens)
        max_tokens = req.max_tokens or default
        check_fits(len(ids), max_tokens, self._largest_verifier())
        has_deadline = remaining is not None and remaining < NO_DEADLINE_SECONDS
        deadline_ms = int((time.time() + remaining) * 1000) if has_deadline else 0
        priority = req.priority or common_pb2.PRIORITY_CLASS_INTERACTIVE
        return scheduler_pb2.SubmitRequest(
            request_id=req.request_id or uuid.uuid4().hex,
            prompt_ids=ids,
            max_tokens=max_tokens,
            sampling=req.sampling,
            stop=list(req.stop),
            priority=priority,
            speculation=req.speculation,
            deadline_unix_ms=deadline_ms,
            session_id=who.scoped(req.session_id) if req.session_id else "",  # a tenant's own
            tenant=who.tenant,
            prefix_scope=prefix.scope_of(self.settings.prefix_cache_scope, who.tenant),
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            grammar=constraint,
        )

    def _tool_parameters(self, req) -> dict[str, dict]:
        """Each tool's parameters schema, by name; a schema that cannot be used is refused,
        naming its tool (compiled here whatever the tool choice: a model may call any)."""
        parameters = tools.tool_parameters(req.tools)
        for i, schema in enumerate(parameters.values()):
            text = json.dumps(schema or {"type": "object"})
            self._check_grammar(common_pb2.Grammar(json_schema=text), f"tools[{i}].parameters")
        return parameters

    def _tool_grammar(self, req, parameters: dict[str, dict]) -> common_pb2.Grammar | None:
        """The grammar a required call or a named function imposes; None for auto and none."""
        choice = req.tool_choice
        only = choice.function if choice.WhichOneof("choice") == "function" else None
        if only is None and choice.mode != "required":
            return None
        markup = self.tokenizer.convert_tokens_to_ids(tools.OPEN)
        special = isinstance(markup, int) and self.grammars.tokenizer.is_special_token(markup)
        return common_pb2.Grammar(lark=tools.tool_grammar(parameters, only, special))

    def _check_grammar(self, constraint: common_pb2.Grammar, field: str = "grammar") -> None:
        """Compiles a grammar (kept: its verifier compiles the same text), so one that cannot
        be used is refused here, naming the request's `field` and why."""
        try:
            text = grammar.source(constraint)
            if text is not None:
                self.grammars.matcher(text)
        except grammar.GrammarError as e:
            raise InvalidRequest(field, str(e)) from None

    async def _stream(self, call: Call, stop: list[str], context, start: int = 0):
        """Chunks of the output stream from token index `start` on; the tokens before it only
        prime the detokenizer and the stop trimmer, so the text continues seamlessly. Each
        index is sent once, whatever the stream holds; a Redis outage pauses the stream
        (for up to REDIS_OUTAGE_SECONDS). After each batch of chunks, how far the client has
        been sent goes to the request's `read` cursor: a yield waits while the client does
        not read (gRPC flow control), so the cursor stops, and the verifier pauses the
        request (`max_unread_tokens`)."""
        detok = IncrementalDetokenizer(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        )
        trimmer = StopTrimmer(stop)
        rid, public_id = call.rid, call.public_id
        call.streaming = True
        metrics.OPEN_STREAMS.inc()
        marked = None  # the cursor as last set
        tail = self.tails.open(rid)
        self._streaming.setdefault(rid, set()).add(id(call))
        opened_ms = int(time.time() * 1000)  # entries older than this are a catch-up
        try:
            while True:
                if marked != start:
                    self.tails.cursors.set(rid, start)
                    marked = start
                entries = await tail.get()
                if entries is None:  # (woken by its reader's failing reads)
                    if tail.outage_seconds() > REDIS_OUTAGE_SECONDS:
                        call.told_to_reattach = True
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"request state is unavailable; re-attach with resume_from={start}",
                        )
                    continue
                for entry_id, fields in entries:
                    ids = [int(t) for t in fields["ids"].split(",")] if fields.get("ids") else []
                    lps = fields["lp"].split(";") if "lp" in fields else []
                    first = int(fields["first"])
                    if skip := max(0, min(len(ids), start - first)):  # delivered before
                        trimmer.push(detok.add(ids[:skip]))
                        ids, lps, first = ids[skip:], lps[skip:], first + skip
                    if ids:
                        text = trimmer.push(detok.add(ids))
                        committed_ms = int(entry_id.partition("-")[0])
                        if committed_ms >= opened_ms:  # (not a catch-up)
                            metrics.DELIVERY.observe(max(0.0, time.time() - committed_ms / 1000))
                        yield generation_pb2.GenerateResponse(
                            request_id=public_id,
                            text=text,
                            token_ids=ids,
                            first_index=first,
                            model_version=fields.get("v", ""),
                            logprobs=map(token_logprob, ids, lps),
                        )
                        start = first + len(ids)
                        call.first_token_at = call.first_token_at or time.monotonic()
                        call.emitted += len(ids)
                        metrics.OUTPUT_TOKENS.inc(len(ids))
                    if "final" in fields:
                        final = json.loads(fields["final"])
                        call.finish = final.get("finish_reason", "")
                        call.pool = final.get("pool", "")
                        yield await self._final_chunk(
                            public_id,
                            final,
                            trimmer.push(detok.flush()) + trimmer.flush(),
                            int(fields["first"]),
                            context,
                        )
                        return
        finally:
            self.tails.close(tail)
            readers = self._streaming[rid]
            readers.discard(id(call))
            if not readers:
                del self._streaming[rid]

    async def _final_chunk(self, rid: str, final: dict, text: str, first: int, context):
        error = final.pop("error", "")
        if final.get("finish_reason") == "FINISH_REASON_ERROR":
            if error.startswith("grammar: "):  # (the request's grammar ran past its limits)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"generation failed: {error or 'unknown'}"
            )
        if final.get("finish_reason") == "FINISH_REASON_CANCELLED":
            await context.abort(grpc.StatusCode.CANCELLED, error or "the request was cancelled")
        if final.get("finish_reason") == "FINISH_REASON_DEADLINE":
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, error or "the deadline passed")
        info = json_format.ParseDict(final, generation_pb2.FinalInfo(), ignore_unknown_fields=True)
        if info.pool:
            metrics.DRAFTED.labels(info.pool).inc(info.speculation.drafted_tokens)
            metrics.ACCEPTED.labels(info.pool).inc(info.speculation.accepted_tokens)
        return generation_pb2.GenerateResponse(
            request_id=rid,
            text=text,
            first_index=first,
            final=info,
            model_version=info.model_version,
        )

    async def cancels_sent(self, timeout: float) -> None:
        """Waits (up to `timeout`) for the cancels of requests whose client left to go out
        (a drain that cuts HTTP streams makes some just before the loop stops)."""
        deadline = time.monotonic() + timeout
        for pending in (self._submits, self._cancels):  # (a Submit that lands makes a cancel)
            if pending and (left := deadline - time.monotonic()) > 0:
                await asyncio.wait(list(pending), timeout=left)

    async def _cancel_quietly(self, rid: str) -> None:
        try:
            await self.scheduler.Cancel(
                scheduler_pb2.SchedulerServiceCancelRequest(request_id=rid),
                timeout=self.settings.timeout_seconds,
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            log.warning(
                "cancel after disconnect failed", extra={"request_id": rid, "code": str(e.code())}
            )

    # --- Cancel, GetModelInfo -----------------------------------------------------------------
    async def Cancel(self, request, context, who: Principal | None = None):
        who = who or await self.authenticate(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        await self._check_id(request.request_id, context)
        rid = who.scoped(request.request_id)
        await self._record(rid, request.request_id, context)
        try:
            resp = await self.scheduler.Cancel(
                scheduler_pb2.SchedulerServiceCancelRequest(request_id=rid),
                timeout=self.settings.timeout_seconds,
            )
        except grpc.RpcError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is unavailable; retry")
        return generation_pb2.CancelResponse(cancelled=resp.cancelled)

    async def GetModelInfo(self, request, context, who: Principal | None = None):
        if who is None:
            await self.authenticate(context)
        ref = self.settings.model
        try:
            verifiers, rollout = await self._io(
                lambda: (self.store.live_verifiers(), self.store.rollout())
            )
        except REDIS_ERRORS:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the registry is unavailable; retry")
        return generation_pb2.GetModelInfoResponse(
            name=self.manifest.get("name", ref.label),
            version=self.manifest.get("version", ""),
            vocab_size=self.limits.vocab_size,
            max_seq_len=self.limits.max_seq_len,
            max_tokens_limit=self.limits.max_tokens_limit,
            sha256=self.manifest["sha256"],
            pools=served_pools(verifiers, rollout["canary_share"]),
        )


def _settled(submitted: asyncio.Future) -> None:
    """A Submit's end, read (so that a failure nobody awaited is not reported as lost)."""
    if not submitted.cancelled():
        submitted.exception()


def served_pools(verifiers: list[dict[str, str]], canary_share: float):
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


def serving_versions(verifiers: list[dict[str, str]], canary_share: float, rid: str) -> list[str]:
    """The model versions that would serve a new request now: those of the pool the share
    sends it to (as the scheduler chooses), from the registry's live verifiers."""
    pools = by_pool(verifiers)
    if not pools:
        return []
    return versions(pools.get(choose_pool(rid, canary_share, set(pools)), []))


def token_logprob(token_id: int, entry: str) -> common_pb2.TokenLogprob:
    """A token's log-probabilities from its output stream entry (common/logprob_format.py)."""
    own, top = logprob_format.decode(entry)
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=own,
        top=[common_pb2.TokenLogprob(token_id=i, logprob=x) for i, x in top],
    )


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


def _handler(service: GenerationService) -> grpc.GenericRpcHandler:
    """The service's methods, each checking the caller's key from the call's headers before
    its request message is read (a call that carries no valid key ends at once, whatever it
    sends or holds back), and then waiting at most first_message_timeout_seconds for that
    message. (Each is served as a stream-stream method for that: a unary request is the same
    on the wire; the handler reads its one message itself. Generate's deserializer reports
    bad bytes cleanly.)"""
    name = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name

    def public(method, deserializer, serializer, streams: bool) -> grpc.RpcMethodHandler:
        async def behavior(requests, context):
            who, request = await service.receive(requests, context)
            if streams:
                async for response in method(request, context, who):
                    yield response
            else:
                yield await method(request, context, who)

        return grpc.stream_stream_rpc_method_handler(
            behavior, request_deserializer=deserializer, response_serializer=serializer
        )

    return grpc.method_handlers_generic_handler(
        name,
        {
            "Generate": public(
                service.Generate,
                _deserialize,
                generation_pb2.GenerateResponse.SerializeToString,
                streams=True,
            ),
            "Cancel": public(
                service.Cancel,
                generation_pb2.CancelRequest.FromString,
                generation_pb2.CancelResponse.SerializeToString,
                streams=False,
            ),
            "GetModelInfo": public(
                service.GetModelInfo,
                generation_pb2.GetModelInfoRequest.FromString,
                generation_pb2.GetModelInfoResponse.SerializeToString,
                streams=False,
            ),
        },
    )


def build(settings: GatewaySettings):
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    path, manifest = models.resolve(settings.model, settings.model_cache_dir)
    manifest = {**manifest, "sha256": models.fingerprint(path, manifest)}
    tokenizer = models.load_tokenizer(path)
    store = RequestStore.connect(settings)
    store.wait_reachable()
    if settings.api_keys_file:
        seeded = KeyStore(store.r).seed(settings.api_keys_file, settings.tiers)
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
    service = GenerationService(settings, tokenizer, store, scheduler, manifest, server.loop)
    asyncio.run_coroutine_threadsafe(service.keep_slots_alive(), server.loop)
    server.grpc.add_generic_rpc_handlers((_handler(service),))
    server.start()
    if settings.http_port is not None:
        names = [manifest.get("name", settings.model.label), *settings.http_model_aliases]
        http = OpenAIHttp(
            service,
            names,
            settings.http_max_body_bytes,
            settings.max_concurrent_rpcs,
            lambda: server.serving,
        )
        server.ports["http"] = server.run(http.start(settings.host, settings.http_port))
        server.drains.append(http.stop)
    server.watch({"redis reachable": store.ping})
    log.info(
        "gateway ready",
        extra={"port": server.port, **server.ports, "model": settings.model.label},
    )

    def on_stop() -> None:
        service.draining = True

    return server, on_stop
