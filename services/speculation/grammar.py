"""Structured outputs: what a request's output must match (a JSON schema, a regular expression
or a Lark grammar), compiled with llguidance, and a matcher per request that says which tokens
may come next.

llguidance (Microsoft's Rust engine behind Guidance, also one of vLLM's and SGLang's backends)
was chosen over xgrammar by measurement on this CPU (docs/design/api.md, "Structured
outputs"): it has no dependencies (xgrammar's wheel pulls triton), compiles a schema in about
a millisecond, computes a token mask without holding the interpreter lock, rolls back, and
bounds its own work per grammar and per token (`LLParserLimits`), so a hostile schema costs a
refusal, not a stalled process.

The gateway compiles every grammar it accepts (a named INVALID_ARGUMENT otherwise); verifiers
compile it again for their matchers. Both keep compiled grammars by their text
(`Grammars`): a matcher for a request is a copy of the compiled one.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

from ..v1 import common_pb2

MAX_GRAMMAR_BYTES = 64 * 1024  # a request's schema, regex or grammar text
CACHED_GRAMMARS = 256
MAX_NESTING, MAX_PROPERTIES, MAX_ENUM_VALUES = 10, 5000, 1000  # as OpenAI bounds a schema
DATA_KEYWORDS = {"enum", "const", "default", "examples"}  # (values, not schemas)
# JSON outputs are written as Python's json.dumps writes them (", " and ": " between items, no
# other whitespace): how models see JSON most (chat templates render tool calls so), and a
# model cannot fill its budget with blank lines. A schema may say otherwise in its own
# "x-guidance" options (e.g. {"whitespace_flexible": true}).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be used; the message says why."""


def source(grammar: common_pb2.Grammar) -> str | None:
    """The llguidance grammar of a request's `grammar` field; None when unset."""
    kind = grammar.WhichOneof("kind")
    if kind is None:
        return None
    text = getattr(grammar, kind)
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{kind}: at most {MAX_GRAMMAR_BYTES} bytes")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema: not valid JSON ({e})") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("json_schema: a schema is a JSON object (or true/false)")
        check_size(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def check_size(schema: object) -> None:
    """OpenAI's bounds on a structured output's schema, so that what its clients send is
    taken and nothing much larger: MAX_NESTING levels of nested objects and arrays,
    MAX_PROPERTIES properties and MAX_ENUM_VALUES enum values in all."""
    properties = enums = 0
    stack = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, depth) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") in ("object", "array"):
            depth += 1
            if depth > MAX_NESTING:
                raise GrammarError(f"json_schema: at most {MAX_NESTING} levels of nesting")
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                properties += len(value)
                stack.extend((v, depth) for v in value.values())
            elif key == "enum" and isinstance(value, list):
                enums += len(value)
            elif key not in DATA_KEYWORDS:
                stack.append((value, depth))
    if properties > MAX_PROPERTIES:
        raise GrammarError(f"json_schema: at most {MAX_PROPERTIES} properties in all")
    if enums > MAX_ENUM_VALUES:
        raise GrammarError(f"json_schema: at most {MAX_ENUM_VALUES} enum values in all")


class Grammars:
    """Compiled grammars for one tokenizer, by their text (the `CACHED_GRAMMARS` most recently
    used); `vocab_size` is the model's (its logits' width, at least the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # (built at first use: ~1 s)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size
                )
            return self._tokenizer

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it does not compile or
        admits no output."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(compiled.get_error()[:500])
            self._probe(compiled)
            with self._lock:
                self._compiled[grammar] = compiled
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _probe(self, matcher: llguidance.LLMatcher) -> None:
        """GrammarError for a grammar whose output cannot start: none admitted (only an end
        of sequence, and no empty output either), or a first token past the engine's limits
        (a grammar that compiles can still need more work per token than they allow)."""
        allowed = np.unpackbits(
            np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little"
        )
        allowed[self.tokenizer.eos_tokens] = 0
        first = np.flatnonzero(allowed)
        if not len(first):
            if not matcher.is_accepting():
                raise GrammarError("it admits no output")
            return
        trial = matcher.deep_copy()
        if not trial.consume_token(int(first[0])):
            raise GrammarError(
                f"it needs more work per token than allowed: {trial.get_error()[:300]}"
            )


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Sets the logits of disallowed tokens to -inf, in place ([rows, vocab] logits, [rows,
    words] int32 bitmasks as llguidance fills them)."""
    rows, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = (masks.to(logits.device, non_blocking=True)[:, :, None] >> bits) & 1
    allowed = allowed.view(rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class Follower:
    """A matcher kept at a history that may move back as well as on (a drafter's view of a
    sequence's output: accepted tokens, and run-ahead ones that may be taken back)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: list[int]):
        self.matcher = matcher
        self.eos_ids = set(eos_ids)  # (never given to the matcher: see `fill`)
        self.tokens: list[int] = []

    def follow(self, tokens: list[int]) -> bool:
        """Moves to `tokens`; False if the grammar does not allow them (the matcher is then
        of no more use)."""
        keep = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            keep += 1
        if keep < len(self.tokens):
            self.matcher.rollback(len(self.tokens) - keep)
            del self.tokens[keep:]
        for token in tokens[keep:]:
            if not self.matcher.consume_token(token):
                return False
            self.tokens.append(token)
        return True

    def fill(self, path: list[int], masks: torch.Tensor, row: int) -> None:
        """Row `row` of `masks`: what may follow the history and then `path`. A path the
        grammar does not allow, or that ends the sequence (llguidance does not count an end
        of sequence among the tokens it rolls back), leaves the row as it was."""
        taken = 0
        for token in path:
            if token in self.eos_ids or self.matcher.validate_tokens([token]) != 1:
                break
            if not self.matcher.consume_token(token):
                break
            taken += 1
        if taken == len(path):
            llguidance.torch.fill_next_token_bitmask(self.matcher, masks, row)
        if taken:
            self.matcher.rollback(taken)
