"""The gateway's typed error: why a call is refused or ended, as a `Code` and a message.

The core raises `GatewayError`; each edge maps it onto its own wire (grpc_api.py: a gRPC
status of the code's name, with a `retry-after-ms` trailer; http_api.py: an HTTP status and
OpenAI's error JSON, with Retry-After). The codes are named as gRPC names the same cases, so
that an audit record names a refusal alike whichever port it came in on.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """What kind of refusal or failure (each as gRPC's status of the same name means it)."""

    INVALID_ARGUMENT = enum.auto()  # the request is malformed or cannot be served as asked
    OUT_OF_RANGE = enum.auto()
    UNAUTHENTICATED = enum.auto()  # no key, or one that is not valid
    PERMISSION_DENIED = enum.auto()  # the key's tier does not allow it
    NOT_FOUND = enum.auto()  # no such request (for this caller)
    CANCELLED = enum.auto()  # the request was cancelled
    ALREADY_EXISTS = enum.auto()  # the request id is taken by a different request
    RESOURCE_EXHAUSTED = enum.auto()  # a quota or a queue is full: retry later
    INTERNAL = enum.auto()  # generation failed
    UNAVAILABLE = enum.auto()  # a dependency (Redis, the scheduler) is down: retry
    DEADLINE_EXCEEDED = enum.auto()  # the deadline passed (or a message did not come in time)


class GatewayError(Exception):
    """A refusal or failure for the client: its `code`, a `message` for people (fields named
    as `field: why`), and, for a quota, how long to wait before a retry (milliseconds)."""

    def __init__(
        self, code: Code, message: str, retry_after_ms: int | None = None, retryable: bool = True
    ):
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms
        self.retryable = retryable  # False: the same request can never succeed; do not resend
