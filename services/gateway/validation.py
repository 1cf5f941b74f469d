"""Validation of public requests: pure functions raising InvalidRequest naming the field."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ..common.capacity import kv_fit_problem
from ..common.logprob_format import MAX_TOP_LOGPROBS
from ..v1 import common_pb2, generation_pb2

ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # request and session ids, matched whole
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI names functions


class InvalidRequest(ValueError):
    """A request field is invalid; `field` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int
    max_tokens_limit: int
    max_stop_strings: int
    max_stop_length: int
    default_max_tokens: int = 256


def validate(req: generation_pb2.GenerateRequest, limits: Limits) -> None:
    """Checks everything that does not need the tokenizer."""
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input", "set one of prompt, prompt_ids or messages")
    if which == "prompt" and not req.prompt:
        raise InvalidRequest("prompt", "must not be empty")
    if which == "prompt_ids":
        if not req.prompt_ids.ids:
            raise InvalidRequest("prompt_ids", "must not be empty")
        for i, t in enumerate(req.prompt_ids.ids):
            if not 0 <= t < limits.vocab_size:
                raise InvalidRequest(
                    f"prompt_ids.ids[{i}]",
                    f"token {t} is outside the vocabulary [0, {limits.vocab_size})",
                )
    if which == "messages":
        if not req.messages.messages:
            raise InvalidRequest("messages", "must hold at least one message")
        for i, m in enumerate(req.messages.messages):
            if m.role not in ("system", "user", "assistant", "tool"):
                raise InvalidRequest(
                    f"messages[{i}].role",
                    f"must be system, user, assistant or tool, got {m.role[:20]!r}",
                )
    _validate_tools(req, which)
    if req.max_tokens < 0 or req.max_tokens > limits.max_tokens_limit:
        raise InvalidRequest(
            "max_tokens",
            f"must be in [1, {limits.max_tokens_limit}] "
            f"(0 means {limits.default_max_tokens}), got {req.max_tokens}",
        )
    _validate_sampling(req.sampling)
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidRequest(
            "stop", f"at most {limits.max_stop_strings} stop strings, got {len(req.stop)}"
        )
    for i, s in enumerate(req.stop):
        if not s or len(s) > limits.max_stop_length:
            raise InvalidRequest(
                f"stop[{i}]", f"must be 1 to {limits.max_stop_length} characters long"
            )
    if req.priority not in common_pb2.PriorityClass.values():
        raise InvalidRequest(
            "priority",
            f"must be PRIORITY_CLASS_INTERACTIVE or PRIORITY_CLASS_BATCH, got {req.priority}",
        )
    if req.speculation.mode not in common_pb2.SpeculationMode.values():
        raise InvalidRequest("speculation.mode", f"unknown mode {req.speculation.mode}")
    if req.speculation.HasField("tree_size") and not 0 <= req.speculation.tree_size <= 256:
        raise InvalidRequest("speculation.tree_size", "must be in [0, 256]")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}"
        )
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    if req.request_id:
        check_id("request_id", req.request_id)
    if req.session_id:
        check_id("session_id", req.session_id)


def _validate_tools(req: generation_pb2.GenerateRequest, which: str) -> None:
    if req.tools and which != "messages":
        raise InvalidRequest("tools", "only with messages (the chat template renders them)")
    names = [t.name for t in req.tools]
    for i, name in enumerate(names):
        if not TOOL_NAME_RE.fullmatch(name):
            raise InvalidRequest(f"tools[{i}].name", "1 to 64 of a-z A-Z 0-9 _ -")
        if name in names[:i]:
            raise InvalidRequest(f"tools[{i}].name", f"{name!r} is named twice")
    choice = req.tool_choice.WhichOneof("choice")
    if choice == "mode" and req.tool_choice.mode not in ("auto", "none", "required"):
        raise InvalidRequest(
            "tool_choice", f"auto, none, required or a function, got {req.tool_choice.mode[:20]!r}"
        )
    if choice == "function" and req.tool_choice.function not in names:
        raise InvalidRequest(
            "tool_choice", f"names no tool of the request: {req.tool_choice.function[:64]!r}"
        )
    if choice and not req.tools:
        raise InvalidRequest("tool_choice", "needs tools")
    forced = choice == "function" or req.tool_choice.mode == "required"
    if forced and req.HasField("grammar"):
        raise InvalidRequest("tool_choice", "a required call is a grammar: not with grammar too")


def check_id(field: str, value: str) -> None:
    """A request or session id: 1 to 128 of A-Z a-z 0-9 . _ : -, nothing else (no newline)."""
    if not ID_RE.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidRequest(field, f"1 to 128 characters of A-Z a-z 0-9 . _ : -, got {shown!r}")


def _validate_sampling(s: common_pb2.SamplingParams) -> None:
    if not math.isfinite(s.temperature) or not 0.0 <= s.temperature <= 2.0:
        raise InvalidRequest("sampling.temperature", f"must be in [0, 2], got {s.temperature}")
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise InvalidRequest("sampling.top_p", f"must be in [0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be >= 0, got {s.top_k}")


def check_prompt_length(n_tokens: int, limits: Limits) -> None:
    if n_tokens >= limits.max_seq_len:
        raise InvalidRequest(
            "prompt",
            f"is {n_tokens} tokens; max_seq_len is "
            f"{limits.max_seq_len}, which must leave room for output",
        )


def check_fits(prompt_tokens: int, max_tokens: int, largest: tuple[int, int, int] | None) -> None:
    """A request must fit the KV budget of some verifier: `largest` is (budget, max_seq_len,
    block_size) of the verifier with the largest budget (None: none registered yet; the
    request may wait)."""
    if largest is None:
        return
    if problem := kv_fit_problem(prompt_tokens, max_tokens, *largest):
        raise InvalidRequest("max_tokens", problem)


def _lenient_class():
    """GenerateRequest with every string field turned into bytes, to find invalid UTF-8."""
    pool = descriptor_pool.DescriptorPool()
    for fd in (common_pb2.DESCRIPTOR, generation_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        proto.name = "lenient/" + proto.name
        proto.package = "lenient." + proto.package
        proto.ClearField("dependency")
        proto.ClearField("service")
        proto.dependency.extend(["lenient/" + d.name for d in fd.dependencies])
        for msg in proto.message_type:
            for f in msg.field:
                if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                if f.type_name.startswith(".specserve."):
                    f.type_name = ".lenient" + f.type_name
        pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("lenient.specserve.v1.GenerateRequest")
    )


_LENIENT = None


def find_invalid_utf8(raw: bytes) -> str | None:
    """The path of the first string field holding invalid UTF-8, or None."""
    global _LENIENT
    if _LENIENT is None:
        _LENIENT = _lenient_class()
    msg = _LENIENT.FromString(raw)

    def walk(m, path: str) -> str | None:
        for f, value in m.ListFields():
            items = value if f.is_repeated else [value]
            for i, v in enumerate(items):
                name = f"{path}{f.name}" + (f"[{i}]" if f.is_repeated else "")
                if isinstance(v, bytes) and f.type == f.TYPE_BYTES:
                    try:
                        v.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif hasattr(v, "ListFields"):
                    if found := walk(v, name + "."):
                        return found
        return None

    return walk(msg, "")
