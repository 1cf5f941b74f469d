"""The audit trail: one record per Generate call, as a JSON log line (logger
`specserve.audit`) and in a Redis stream of bounded length (store.schema: audit). Ids, sizes,
status and timing only: never prompt or output text."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..common.outage import REDIS_ERRORS
from ..store import RequestStore
from .keys import ANONYMOUS, Principal

log = logging.getLogger("specserve.audit")


@dataclass
class Call:
    """One Generate call as the gateway saw it (what the audit record and the quota release
    are made of)."""

    peer: str
    protocol: str = "grpc"  # or "http" (the OpenAI-compatible API, which cannot re-attach)
    started: float = field(default_factory=time.monotonic)
    who: Principal = ANONYMOUS
    public_id: str = ""  # the request id the client knows
    rid: str = ""  # the request id as stored (scoped to the tenant)
    stream: str = ""  # the quota stream slot this call holds, if any
    resumed: bool = False
    prompt_tokens: int = 0
    max_tokens: int = 0
    priority: str = ""
    emitted: int = 0  # tokens sent to the client
    first_token_at: float = 0.0  # monotonic time of the first token sent
    streaming: bool = False  # the request is accepted and its output is being streamed
    submitted: Any = None  # the Submit to the scheduler (an asyncio future), once sent
    finish: str = ""  # the finish reason, once the final chunk went out
    told_to_reattach: bool = False  # ended by the gateway: re-attach with resume_from
    pool: str = ""  # rollout pool of the verifier that finished it (from the final chunk)
    span: Any = None  # the call's span (gateway.generate)
    trace_ctx: Any = None  # a context holding it: the parent of what the call does

    def record(self, status: str) -> dict:
        return {
            "tenant": self.who.tenant,
            "key_id": self.who.key_id,
            "request_id": self.public_id,
            "client": self.peer,
            "protocol": self.protocol,
            "priority": self.priority,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.emitted,
            "resumed": self.resumed,
            "status": status,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 1),
        }


class Audit:
    """Writes audit records: a log line each, and an entry of the store's audit stream (which
    keeps about the last `max_entries`)."""

    def __init__(self, store: RequestStore, max_entries: int):
        self.store = store
        self.max_entries = max_entries

    def write(self, record: dict) -> None:
        log.info("audit", extra=record)
        try:
            fields = {k: str(v) for k, v in record.items()}
            self.store.append_audit(fields, self.max_entries)
        except REDIS_ERRORS:
            log.warning("audit stream unavailable; the log line stands")
