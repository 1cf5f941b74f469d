"""The gateway's gRPC port, `specserve.v1.GenerationService`: its calls onto the core's
(core.py), and the core's typed errors onto gRPC statuses (a code's name is its status's;
a retry hint goes as the `retry-after-ms` trailer).

Each method checks the caller's key from the call's headers before its request message is
read, then waits at most first_message_timeout_seconds for that message (`receive`).
"""

from __future__ import annotations

import asyncio
import time
from typing import NoReturn

import grpc

from ..v1 import generation_pb2, generation_pb2_grpc
from .audit import Call
from .core import Gateway
from .errors import Code, GatewayError
from .keys import ANONYMOUS, Principal
from .validation import find_invalid_utf8

NO_DEADLINE_SECONDS = 10 * 365 * 86400  # a client deadline further out than this is none


class _BadBytes:
    """Stands in for a request whose bytes do not parse; Generate answers INVALID_ARGUMENT."""

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
    """The public API over gRPC: each method is given its caller (`receive`) and maps the
    messages of its call onto the core's."""

    def __init__(self, core: Gateway):
        self.core = core

    async def receive(self, requests, context) -> tuple[Principal, object]:
        """A call's caller, from its headers, then its one request message, which must come
        within first_message_timeout_seconds (`Quotas.awaiting_request` meanwhile). A call
        refused here is counted and audited as a refused Generate is."""
        timeout = self.core.settings.first_message_timeout_seconds
        who = ANONYMOUS
        try:
            who = await self.core.authenticate(_authorization(context))
            try:
                with self.core.quotas.awaiting_request(who):
                    request = await asyncio.wait_for(anext(requests, None), timeout)
            except TimeoutError:
                raise GatewayError(
                    Code.DEADLINE_EXCEEDED,
                    f"no request message arrived within {timeout:g}s of the call's headers",
                ) from None
            if request is None:
                raise GatewayError(Code.INVALID_ARGUMENT, "the call sent no request")
            return who, request
        except GatewayError as e:
            self.core.calls.refused(Call(peer=context.peer(), who=who), e.code.name)
            await _abort(context, e)

    async def Generate(self, request, context, who: Principal):
        calls = self.core.calls
        call = Call(peer=context.peer(), protocol="grpc")
        calls.begin(call, context.invocation_metadata())
        context.add_done_callback(
            lambda ctx: calls.ended(call, _code_name(ctx), ctx.cancelled(), reattaches=True)
        )
        try:
            if isinstance(request, _BadBytes):
                raise GatewayError(
                    Code.INVALID_ARGUMENT,
                    f"{request.field}: is not valid UTF-8 (or the message is malformed)",
                )
            async for chunk in await self.core.generate(call, request, who, _deadline(context)):
                yield chunk
        except GatewayError as e:
            await _abort(context, e)

    async def Cancel(self, request, context, who: Principal):
        try:
            cancelled = await self.core.cancel(who, request.request_id)
        except GatewayError as e:
            await _abort(context, e)
        return generation_pb2.CancelResponse(cancelled=cancelled)

    async def GetModelInfo(self, request, context, who: Principal):
        try:
            return await self.core.model_info()
        except GatewayError as e:
            await _abort(context, e)


async def _abort(context: grpc.aio.ServicerContext, error: GatewayError) -> NoReturn:
    """Ends the call with the error's status (and its retry hint as a trailer)."""
    if error.retry_after_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(error.retry_after_ms)),))
    await context.abort(grpc.StatusCode[error.code.name], error.message)


def _authorization(context: grpc.aio.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get("authorization", "")


def _code_name(context: grpc.aio.ServicerContext) -> str | None:
    """The status the call ended with, by name (None if none was set)."""
    code = context.code()
    return code.name if code else None


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The client's deadline in time.monotonic() seconds; None when it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining >= NO_DEADLINE_SECONDS:
        return None
    return time.monotonic() + remaining


def handler(service: GenerationService) -> grpc.GenericRpcHandler:
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
