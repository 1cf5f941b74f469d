"""A client's `GenerateRequest` made into the scheduler's `SubmitRequest`: validated,
tokenized (a text prompt, or chat messages through the model's chat template, with their
tools), its grammar compiled, and checked to fit the largest verifier's KV budget.

Blocking and CPU-bound (the tokenizer, grammar compilation): the core runs it on threads of
its own. A request that cannot be served is refused with `InvalidRequest`, naming its field.
"""

from __future__ import annotations

import json
import time
import uuid

from ..common import prefix
from ..common.outage import REDIS_ERRORS
from ..common.settings import GatewaySettings
from ..speculation import grammar
from ..store import RequestStore
from ..v1 import common_pb2, generation_pb2, scheduler_pb2
from . import tools
from .keys import Principal
from .validation import InvalidRequest, Limits, check_fits, check_prompt_length, validate

REGISTRY_TTL_SECONDS = 1.0  # how long the verifiers' largest KV budget is reused


class Preparer:
    """Prepares requests for the tokenizer's model, under `limits`; the largest verifier's
    KV budget is read from the registry in `store` (and reused for REGISTRY_TTL_SECONDS)."""

    def __init__(self, settings: GatewaySettings, tokenizer, limits: Limits, store: RequestStore):
        self.settings, self.tokenizer, self.limits, self.store = settings, tokenizer, limits, store
        self.grammars = grammar.Grammars(tokenizer, len(tokenizer))
        self._largest: tuple[float, tuple[int, int, int] | None] = (0.0, None)

    def submit_request(
        self, req: generation_pb2.GenerateRequest, remaining: float | None, who: Principal
    ) -> scheduler_pb2.SubmitRequest:
        """The scheduler's request; `remaining` is the client's deadline in seconds (None
        when it set none)."""
        validate(req, self.limits)
        ids, parameters = self._prompt(req)
        if not ids:
            raise InvalidRequest(req.WhichOneof("input"), "tokenizes to no tokens")
        check_prompt_length(len(ids), self.limits)
        constraint, field = req.grammar, "grammar"
        if parameters is not None and (required := self._tool_grammar(req, parameters)):
            constraint, field = required, "tool_choice"
        self._check_grammar(constraint, field)
        default = self.limits.default_max_tokens
        if who.limits is not None:
            default = min(default, who.limits.max_tokens)
        max_tokens = req.max_tokens or default
        check_fits(len(ids), max_tokens, self._largest_verifier())
        deadline_ms = int((time.time() + remaining) * 1000) if remaining is not None else 0
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

    def _prompt(self, req) -> tuple[list[int], dict[str, dict] | None]:
        """The prompt's token ids; for chat messages, also each tool's parameters schema."""
        which = req.WhichOneof("input")
        if which == "prompt_ids":
            return list(req.prompt_ids.ids), None
        if which == "prompt":
            return self.tokenizer(req.prompt).input_ids, None
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
        return self.tokenizer(text).input_ids, parameters

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

    def _largest_verifier(self) -> tuple[int, int, int] | None:
        fetched, largest = self._largest
        if time.monotonic() - fetched > REGISTRY_TTL_SECONDS:
            try:
                largest = self.store.largest_verifier()
            except REDIS_ERRORS:
                largest = None  # the scheduler queues it; admission still never overcommits
            self._largest = (time.monotonic(), largest)
        return largest
