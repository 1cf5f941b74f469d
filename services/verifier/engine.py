"""The verifier's decode loop: admit; then per step plan, draft, verify, accept, emit, retire.

One thread runs the loop; RPC handlers only hand it work through `admit` and `cancel`.
Each part of the engine owns its own state:
- batch.py: the running batch, the sequences joining it and which were cancelled;
- constraint.py (`StepGrammar`): the step's drafts and masks under the requests' grammars;
- writes.py: each step's tokens to Redis, fenced by ownership (a request this verifier lost,
  requeued while it was thought dead, is dropped, not written), and what Redis answers;
- lifecycle.py: how the work here ends (drain, a lost tensor-parallel rank): the requests
  are handed back to the queue with their progress.

Continuous batching: sequences join and leave at every step. A prompt is prefilled in chunks
of at most `max_prefill_tokens` per step (interactive prompts first), in the same forward pass
as the running sequences' decode steps, so a long prompt never stalls them.
KV memory is blocks (admission.py): a sequence holds what its tokens fill, and full blocks are
shared by prefix. A step that needs more blocks than are free drops its drafts, then preempts
(preemption.py); preempted sequences resume first, recomputed, once their blocks are free.
A sequence more than `max_unread_tokens` ahead of what its client was sent is paused: it
keeps its slot and KV but takes no part in steps until its client reads again, and ends
(cancelled) after `pause_timeout_seconds`, freeing both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from ..common.outage import REDIS_ERRORS, REDIS_UNREACHABLE, OutageLog
from ..common.settings import (
    BatchSettings,
    SpeculationSettings,
    StreamSettings,
    VerifierSettings,
)
from ..engine.tensor_parallel import ShardsLost
from ..speculation.acceptance import Candidates, NonFinite, Verdict, select_each
from ..speculation.sampling import make_generator
from ..speculation.tree import DraftTree
from ..store import RequestStore, StepState
from . import logprobs, metrics, preemption, stages
from .admission import Admission, Grant
from .constraint import GrammarViolation, StepGrammar
from .lifecycle import Lifecycle
from .runner import ModelRunner, describe
from .running import RunningBatch
from .sequence import Committed, Sequence
from .speculator import Speculator
from .step_plan import StepPlan, plan_step
from .writes import Owner, StepWrites

log = logging.getLogger(__name__)

STATUS_BY_REASON = {
    "FINISH_REASON_CANCELLED": "cancelled",
    "FINISH_REASON_ERROR": "failed",
    "FINISH_REASON_DEADLINE": "expired",
}


def engine_settings(**keys) -> dict:
    """The settings groups an `Engine` takes (`Engine(..., **engine_settings(...))`), from
    verifier keys, the rest at their defaults: for an engine built outside the service."""
    settings = VerifierSettings(**keys)
    return {"batch": settings.batch, "stream": settings.stream, "speculation": settings.speculation}


class Engine:
    """The decode loop and its step; its parts (`batch`, `grammar`, `writes`, `lifecycle`)
    are named in the module's docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        speculator: Speculator,
        store: RequestStore,
        admission: Admission,
        *,
        batch: BatchSettings,
        stream: StreamSettings,
        speculation: SpeculationSettings,
        owner: Owner,
        eos_ids: set[int],
        decode: Callable[[list[int]], str],
        max_failed_steps: int = 3,
    ):
        self.runner = runner
        self.speculator = speculator
        self.admission = admission
        self.max_seq_len = batch.max_seq_len
        self.max_prefill_tokens = batch.max_prefill_tokens
        self.pause_timeout_seconds = stream.pause_timeout_seconds
        self.eos_ids = eos_ids
        self.decode = decode
        self.batch = RunningBatch()
        self.running = self.batch.running  # (the batch's: read here, changed through it)
        self.writes = StepWrites(store, owner, stream, self.running)
        self.lifecycle = Lifecycle(self)
        self.grammar = StepGrammar(batch.max_seq_len, speculation.forced_drafts)
        self.steps = 0
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0  # steps in a row that failed for every sequence in them
        self._outage = OutageLog(log, "decode loop")
        self.tick = time.monotonic()  # when the loop last went round (the wedge check)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- called from RPC threads ----------------------------------------------------------
    def admit(self, seq: Sequence, grant: Grant) -> None:
        """Hands a sequence admitted with `grant` (and claimed) to the loop; it joins at the
        next step with the blocks its grant holds (a cached prefix among them)."""
        seq.generator = make_generator(seq.params, self.runner.model.device)  # where logits are
        seq.kv, seq.cached_tokens = grant.kv, grant.cached_tokens
        metrics.PREFIX_CACHE_TOKENS.inc(grant.cached_tokens)
        self.batch.join(seq)

    def cancel(self, request_id: str) -> bool:
        return self.batch.cancel(request_id, self.steps)

    def running_ids(self) -> list[str]:
        """The requests in the batch, and those admitted that join it at the next step."""
        return self.batch.ids()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    def alive(self, stall_seconds: float) -> bool:
        """False if the loop thread died or one round has taken over `stall_seconds`."""
        return self.thread.is_alive() and time.monotonic() - self.tick < stall_seconds

    def healthy(self) -> bool:
        """False once `max_failed_steps` steps in a row failed for every sequence in them:
        then the model, the device or the loop is broken, not one request."""
        return self.failed_steps < self.max_failed_steps

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick = time.monotonic()
            if why := self.runner.lost():
                self.lifecycle.lose(why)
                return
            self._take_new(block=not self._runnable())
            if not self.running:
                continue
            try:  # on a Redis error the tokens stay in memory, written by a later step
                ok = self.step() if self._runnable() else self._watch_paused()
            except REDIS_UNREACHABLE as e:
                self._outage.failed(e)
                self._stop.wait(0.5)
                continue
            except REDIS_ERRORS:
                log.exception("redis error in step; retrying")
                self._stop.wait(0.5)
                continue
            except ShardsLost as e:
                self.lifecycle.lose(str(e))
                return
            except Exception as e:
                ok = False
                self._fail_running(e)
            self._outage.succeeded()
            if not ok:
                metrics.FAILED_STEPS.inc()
            self.failed_steps = 0 if ok else self.failed_steps + 1

    def _fail_running(self, error: Exception) -> None:
        """A step failed outside any one sequence's part: every running sequence ends with
        the error (with the tokens it has); none is retried forever."""
        log.exception("step failed", extra={"requests": len(self.running)})
        for seq in self.running.values():
            if not seq.finish_reason:
                seq.finish_reason = "FINISH_REASON_ERROR"
                seq.error = f"the verifier's step failed: {describe(error)}"
                metrics.FAILED_SEQUENCES.inc()

    def _take_new(self, block: bool) -> None:
        for seq in self.batch.take_new(block):
            if seq.restored:  # taken over: it may have ended with its last restored token
                self._finished(seq)

    def step(self) -> bool:
        """Plan, draft, verify, accept, emit: one forward pass for every running sequence.
        False when the step failed for every sequence in it."""
        self._resume()
        plan = self._plan()
        ok = True
        if plan.parts:
            with stages.step_span(plan) as span:
                trees = self._fit(plan, self.grammar.guide(plan, self._draft(plan, span)))
                masks = self.grammar.masks(plan, trees)  # (computed while the forward runs)
                logits = self._verify(plan, trees)
                ok = self._accept(plan, trees, logits, masks.result(), span)
        self.steps += 1
        metrics.STEPS.inc()
        self._emit(list(self.running.values()))
        return ok

    def _plan(self) -> StepPlan:
        """The step's sequences and what each feeds (step_plan.py). A deadline that passed
        ends its sequence at the end of the step (`_emit`)."""
        self.batch.mark_cancelled()
        return plan_step(self.running.values(), self.max_prefill_tokens)

    def _resume(self) -> None:
        """Preempted sequences take their blocks back while they are free (preemption.py);
        admission waits while any is still waiting."""
        self.admission.resuming = preemption.resume_waiting(
            list(self.running.values()),
            self.runner.model.pool,
            self.admission.prefix_cache,
            self.admission.watermark_blocks,
        )

    def _fit(self, plan: StepPlan, trees: list[DraftTree]) -> list[DraftTree]:
        """The step's trees, and its plan, cut to the free KV blocks (preemption.py)."""
        trees = preemption.fit(plan, trees, self.running.values(), self.runner.model.pool)
        self.admission.resuming = sum(s.preempted for s in self.running.values())
        return trees

    def _draft(self, plan: StepPlan, span) -> list[DraftTree]:
        """The step's draft trees; none (plain decoding) if drafting itself breaks."""
        with stages.stage("draft", metrics.DRAFT_SECONDS):
            try:
                trees = self.speculator.propose(plan.seqs, plan.prefill_tokens, plan.first_token)
            except Exception:  # drafting is an optimisation: the step runs plainly
                log.exception("drafting failed; this step runs without drafts")
                trees = [DraftTree() for _ in plan.parts]
        stages.drafted(span, trees)
        return trees

    def _verify(self, plan: StepPlan, trees: list[DraftTree]) -> list[torch.Tensor | Exception]:
        """The target's logits per sequence, or the error that stops it (runner.py)."""
        with stages.stage("verify", metrics.VERIFY_SECONDS) as timing:
            logits = self.runner.verify_each(plan.seqs, trees, plan.takes)
        tokens = sum(plan.takes) + sum(map(len, trees))
        self.speculator.observe_step(tokens, timing.seconds, plan.prefill_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step",
                extra={
                    "sequences": len(plan.seqs),
                    "tokens": tokens,
                    "prefill_tokens": plan.prefill_tokens,
                    "trees": [len(t) for t in trees],
                    "model_free": sum(t.model_free for t in trees if len(t)),
                    "verify_ms": round(1000 * timing.seconds, 1),
                    "priced_ms": round(1000 * self.speculator.priced_verify(tokens), 1),
                },
            )
        return logits

    def _accept(
        self, plan: StepPlan, trees: list[DraftTree], logits: list, masks: list, span
    ) -> bool:
        """Accepts, commits and appends each sequence's tokens. A failure is the failing
        sequence's alone: it ends with FINISH_REASON_ERROR, its KV back at its last committed
        length, while the rest of the batch goes on as if it had never been there."""
        logits = [  # (a grammar that can go no further ends its sequence, with why)
            mask if isinstance(mask, GrammarViolation) else rows
            for rows, mask in zip(logits, masks, strict=True)
        ]
        ready = [  # (a prefill chunk yields no token until the prompt is all in)
            (part.seq, tree, rows, mask)
            for part, tree, rows, mask in zip(plan.parts, trees, logits, masks, strict=True)
            if part.complete and not isinstance(rows, Exception)
        ]
        decided = select_each(
            [
                Candidates(tree, rows, seq.params, seq.generator, mask)
                for seq, tree, rows, mask in ready
            ]
        )
        scored = [
            (rows, verdict, seq.top_logprobs)
            for (seq, _, rows, _), verdict in zip(ready, decided, strict=True)
            if seq.logprobs and isinstance(verdict, Verdict)
        ]
        if scored:  # (from the rows this step computed: one transfer for them all)
            logprobs.score(*zip(*scored, strict=True))
        verdicts = iter(decided)
        accepted = 0
        for part, tree, rows in zip(plan.parts, trees, logits, strict=True):
            if isinstance(rows, Exception):
                self._fail(part.seq, part.was, describe(rows))
            elif part.complete:
                if part.prefilling:
                    stages.prefilled(part.seq)
                accepted += self._settle(part.seq, tree, next(verdicts), part.was)
            kv, seq = part.seq.kv, part.seq
            tokens = len(seq.prompt_ids) + len(seq.output_ids)
            if self.admission.prefix_cache and kv is not None and kv.sealable(tokens):
                kv.seal(seq.all_ids)  # its full blocks are shareable now
        span.set_attribute("accepted_tokens", accepted)
        return not all(s.finish_reason == "FINISH_REASON_ERROR" for s in plan.seqs)

    def _settle(
        self, seq: Sequence, tree: DraftTree, verdict: Verdict | Exception, was: Committed
    ) -> int:
        """Commits and appends one sequence's accepted tokens; a failure (in its selection,
        too) ends that sequence alone. Returns how many draft tokens it accepted."""
        if isinstance(verdict, NonFinite):  # (its rows, not the engine: no traceback)
            self._fail(seq, was, str(verdict))
            return 0
        try:
            if isinstance(verdict, Exception):
                raise verdict
            if seq.logprobs and verdict.logprobs is None:
                raise RuntimeError("its tokens' log-probabilities could not be computed")
            return self._commit(seq, tree, verdict)
        except Exception as e:
            log.exception("step failed for one request", extra={"request_id": seq.request_id})
            self._fail(seq, was, describe(e))
            return 0

    def _fail(self, seq: Sequence, was: Committed, why: str) -> None:
        """Ends a sequence with FINISH_REASON_ERROR at its state before this step: its KV and
        output go back to what was committed; its slot and reservation go when it retires."""
        was.rewind(seq)
        del seq.output_ids[was.outputs :]
        del seq.output_logprobs[was.outputs :]
        seq.finish_reason, seq.error = "FINISH_REASON_ERROR", why
        metrics.FAILED_SEQUENCES.inc()
        log.warning("request failed in a step", extra={"request_id": seq.request_id, "error": why})

    def _commit(self, seq: Sequence, tree: DraftTree, verdict: Verdict) -> int:
        """Keeps the KV of what the target agreed with, appends its tokens; returns how many
        draft tokens it accepted."""
        self.runner.commit(seq, tree, verdict.accepted)
        emitted = seq.extend(verdict.tokens, self._finished, verdict.logprobs)
        accepted = min(len(verdict.accepted), emitted)
        if len(tree):  # the path was checked up to its first rejection, if it had one
            self.speculator.observe_acceptance(
                seq, tree, verdict.accepted, tree.tested(len(verdict.accepted))
            )
        seq.accepted += accepted
        seq.steps += 1
        stages.accepted(seq, len(tree), accepted, emitted)
        return accepted

    def _finished(self, seq: Sequence) -> str | None:
        return seq.check_finished(self.eos_ids, self.max_seq_len, self._tail_text)

    def _emit(self, seqs: list[Sequence]) -> None:
        """Writes new tokens to Redis in one round trip (writes.py); retires the sequences
        that ended and drops those this verifier no longer owns. With async writes, what it
        acts on is the last step's write (a sequence's state and end come a step later), and
        this step's travels while the next step computes."""
        for seq, state in self.writes.answered(seqs):
            if state == StepState.LOST:
                self.drop(seq, "lost: the request was requeued elsewhere")
                continue
            seq.cancelled |= state == StepState.CANCELLED
            if seq.end_if_paused(self.pause_timeout_seconds):
                metrics.UNREAD_ENDED.inc()
            if self._finished(seq) and seq.num_emitted == len(seq.output_ids):
                self._retire(seq)  # (with tokens still unwritten, after the next write)
        self.writes.send(list(self.running.values()))

    def _runnable(self) -> bool:
        """True if a running sequence is not paused."""
        return any(s.paused_since is None for s in self.running.values())

    def _watch_paused(self) -> bool:
        """Every sequence is paused, so no step runs: one write checks whether their clients
        read again (or the pause timed out)."""
        self._emit(list(self.running.values()))
        return True

    def _tail_text(self, seq: Sequence) -> str:
        longest = max(len(s) for s in seq.stop)
        return self.decode(seq.output_ids[-(longest + 8) :])

    def _retire(self, seq: Sequence) -> None:
        status = STATUS_BY_REASON.get(seq.finish_reason, "finished")
        if seq.kv_kept is None:  # once, even if finishing in Redis fails and is retried
            self._free(seq)
            seq.kv_kept = self.admission.prefix_cache and status == "finished"
        owned = self.writes.finish(seq, status)
        cancel_steps = self._forget(seq)
        if cancel_steps is not None:
            metrics.CANCEL_STEPS.observe(cancel_steps)
        log.info(
            "request ended" if owned else "request lost: requeued elsewhere",
            extra={
                "request_id": seq.request_id,
                "status": status,
                "tokens": len(seq.output_ids),
                "steps": seq.steps,
                "cancel_steps": cancel_steps,
            },
        )

    def drop(self, seq: Sequence, why: str) -> None:
        """Removes a sequence without ending its request (another verifier goes on with it)."""
        if seq.kv_kept is None:
            self._free(seq)
            seq.kv_kept = False
        self._forget(seq)
        log.info("request dropped", extra={"request_id": seq.request_id, "reason": why})

    def _free(self, seq: Sequence) -> None:
        """Gives back the sequence's blocks (its sealed ones stay cached) and its slot."""
        self.runner.release(seq)
        self.admission.release(seq.request_id)
        self.speculator.forget(seq)

    def _forget(self, seq: Sequence) -> int | None:
        """Removes the sequence from the batch; the steps since it was cancelled, if it was."""
        cancelled_at = self.batch.remove(seq)
        return None if cancelled_at is None else self.steps - cancelled_at
