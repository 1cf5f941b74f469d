"""One running request on a verifier: its tokens, progress counters and finish rules."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.flat_model import SequenceKV
from ..speculation.policy import SequenceScores
from ..speculation.sampling import SamplingParams
from ..speculation.tree import DraftTree
from .constraint import Constraint


@dataclass
class Shadow:
    """A model-free tree that a step did not check in full, scored afterwards against the
    tokens the sequence went on to emit (Speculator._shadowed). A model-free node is kept
    when the target's token at its place is its token, so the tokens emitted say which of
    its nodes the target would have kept: exactly when greedy, with the same chances when
    sampled (a point-mass draft is accepted with the target's probability of its token)."""

    tree: DraftTree  # as the drafter sent it
    start: int  # len(output_ids) when it came: its root's children follow output_ids[:start]
    checked: int  # its first nodes that the step checked (observed as any checked tree)
    kids: dict[int, list[int]] = field(default_factory=dict)  # tree.children()
    path: list[int] = field(default_factory=list)  # the nodes the tokens since have followed


@dataclass
class Sequence:
    """A request in the running batch. Progress is counters: num_computed tokens are in the KV
    cache; output_ids[num_emitted:] are generated but not yet written to Redis."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    queue: str
    entry_id: str
    created_ms: int
    admitted_ms: int
    speculate: bool = True  # False when the request pinned speculation off
    tree_size: int | None = None  # the request's fixed tree size, if it set one
    session_id: str = ""
    tenant: str = ""  # whose earlier outputs may shape its drafts
    prefix_scope: str = ""  # whose cached blocks it may reuse ("": anyone's; prefix.scope_of)
    deadline_ms: int = 0  # unix ms after which the request stops (0: none)
    trace_ctx: Any = None  # the request's trace context here (its Admit span), if traced
    restored: int = 0  # output tokens generated before this verifier took the request over
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    kv_kept: bool | None = None  # set when retired: whether its blocks stay in the prefix cache
    preempted: bool = False  # its KV was given up for room; it waits to be recomputed
    preemptions: int = 0
    recompute_to: int = 0  # tokens to prefill again after a preemption (prompt and output)
    output_ids: list[int] = field(default_factory=list)
    logprobs: bool = False  # whether its tokens' log-probabilities are returned ...
    top_logprobs: int = 0  # ... with this many most likely tokens each
    output_logprobs: list[str] = field(default_factory=list)  # with logprobs: per output id
    constraint: Constraint | None = None  # its grammar, at its output so far
    grammar: str = ""  # that grammar's text (llguidance's), for the drafters
    num_emitted: int = 0
    kv: SequenceKV | None = None  # the target's KV entries of all_ids[:kv.length]
    generator: torch.Generator | None = None
    cancelled: bool = False
    paused_since: float | None = None  # monotonic; set while its client is not reading
    finish_reason: str | None = None  # FinishReason enum name once finished
    error: str = ""
    steps: int = 0
    drafted: int = 0  # draft nodes proposed to the target
    accepted: int = 0  # draft tokens the target accepted (and were emitted)
    tested: int = 0  # draft tokens the target checked: accepted ones and first rejections
    # accepted and tested (uncapped by the finish) split by kind of tree, for the policy:
    free_accepted: int = 0  # model-free trees (suffix, n-gram)
    free_tested: int = 0
    free_trees: int = 0  # model-free trees checked
    drawn_accepted: int = 0  # draft-model trees
    drawn_tested: int = 0
    scored: SequenceScores = field(default_factory=SequenceScores)  # scored trees' record
    shadow: Shadow | None = None  # a tree not checked in full, until its nodes are decided
    # Tokens its draft model had taken in when it last grew it a tree (0: never): what it
    # takes in before its next one is the rest (a catch-up, where more than a step's worth).
    drawn_at: int = 0
    free_asked: int = 0  # steps that asked the drafter for a model-free tree alone ...
    free_matched: int = 0  # ... and of them those that got one worth checking (not empty)
    free_misses: int = 0  # such asks in a row that got none ...
    free_next: int = 0  # ... and the step of the next (Speculator._asked_alone)
    fallback_steps: int = 0
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0  # unix ms of the first generated token
    last_token_ms: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_computed(self) -> int:
        return self.kv.length if self.kv is not None else 0

    @property
    def num_pending(self) -> int:
        """Tokens the model has not seen yet."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    @property
    def prefilling(self) -> bool:
        """True until the whole prompt is in the KV cache (it may take several chunks); for a
        request taken over from another verifier, the prompt and the restored tokens; after a
        preemption, every token it had."""
        return self.num_computed < max(len(self.prompt_ids) + self.restored, self.recompute_to)

    def pending_input(self, limit: int | None = None) -> list[int]:
        """Tokens the model has not seen yet (the prompt at first, then the last token); at
        most `limit` of them (a prefill chunk)."""
        start = self.num_computed
        end = None if limit is None else start + limit
        return self.all_ids[start:end]

    def pause(self, paused: bool) -> bool:
        """Pauses the sequence (its client is not reading) or lets it go on; True if that
        changed anything."""
        if paused == (self.paused_since is not None):
            return False
        self.paused_since = time.monotonic() if paused else None
        return True

    def end_if_paused(self, timeout_seconds: float) -> bool:
        """Ends the sequence (cancelled) if it has been paused for `timeout_seconds`: nobody
        reads what it makes. True if it ended now."""
        since = self.paused_since
        if since is None or self.finish_reason or time.monotonic() - since < timeout_seconds:
            return False
        self.finish_reason = "FINISH_REASON_CANCELLED"
        self.error = f"its client read no output for {timeout_seconds:g}s (pause_timeout_seconds)"
        return True

    def extend(
        self,
        tokens: list[int],
        finished: Callable[[Sequence], str | None],
        logprobs: list[str] | None = None,
    ) -> int:
        """Appends tokens (and with `logprobs` on, their entries) until `finished` names a
        reason; returns how many were appended."""
        now = time.time() * 1000
        if not self.output_ids:
            self.first_token_ms = now
        self.last_token_ms = now
        for count, token in enumerate(tokens, 1):
            if self.constraint is not None:
                self.constraint.consume(token)
            self.output_ids.append(token)
            if self.logprobs:
                self.output_logprobs.append(logprobs[count - 1])
            if finished(self):
                return count
        return len(tokens)

    def check_finished(self, eos_ids: set[int], max_seq_len: int, decode_tail: Any) -> str | None:
        """Sets and returns the finish reason, if the sequence is done after its last token."""
        if self.finish_reason:
            return self.finish_reason
        reason = None
        if self.cancelled:
            reason = "FINISH_REASON_CANCELLED"
        elif self.deadline_ms and time.time() * 1000 >= self.deadline_ms:
            reason = "FINISH_REASON_DEADLINE"
            self.error = "the deadline passed while it ran"
        elif self.output_ids and self.output_ids[-1] in eos_ids:
            reason = "FINISH_REASON_EOS"
        elif self.constraint is not None and self.constraint.complete:
            reason = "FINISH_REASON_STOP"  # the output is whole: its grammar allows no more
        elif self.stop and any(s in decode_tail(self) for s in self.stop):
            reason = "FINISH_REASON_STOP"
        elif len(self.output_ids) >= self.max_tokens:
            reason = "FINISH_REASON_LENGTH"
        elif len(self.prompt_ids) + len(self.output_ids) >= max_seq_len:
            reason = "FINISH_REASON_MAX_SEQ_LEN"
        self.finish_reason = reason
        return reason

    def final_info(self) -> dict[str, Any]:
        """The FinalInfo message as a JSON dict (proto field names)."""
        end = self.last_token_ms or time.time() * 1000
        return {
            "finish_reason": self.finish_reason or "FINISH_REASON_ERROR",
            "usage": {
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": len(self.output_ids),
                "cached_prompt_tokens": self.cached_tokens,
                "preemptions": self.preemptions,
            },
            "timings": {
                "queue_ms": max(0.0, self.admitted_ms - self.created_ms),
                "prefill_ms": self.prefill_ms,
                "decode_ms": max(0.0, end - self.first_token_ms) if self.first_token_ms else 0.0,
                "ttft_ms": max(0.0, self.first_token_ms - self.created_ms)
                if self.first_token_ms
                else 0.0,
            },
            "speculation": {
                "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "mean_accepted_length": len(self.output_ids) / self.steps if self.steps else 0.0,
                "steps": self.steps,
                "fallback_steps": self.fallback_steps,
            },
            "error": self.error,
        }


@dataclass(frozen=True)
class Committed:
    """A sequence's progress at the start of a step: what a failure in the step rewinds to."""

    kv_length: int
    outputs: int

    @classmethod
    def of(cls, seq: Sequence) -> Committed:
        return cls(seq.num_computed, len(seq.output_ids))

    def rewind(self, seq: Sequence) -> None:
        if seq.kv is not None:
            seq.kv.truncate(self.kv_length)
        if seq.constraint is not None:
            seq.constraint.rollback_to(self.outputs)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
