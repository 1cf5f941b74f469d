"""The verifier's decode loop: admit; then per step plan, draft, verify, accept, emit, retire.

One thread runs the loop; RPC handlers only hand it work through `admit` and `cancel`.
Every step's tokens are written to Redis before the next step runs, fenced by ownership: a
request this verifier lost (requeued while it was thought dead) is dropped, not written.
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
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..common.outage import REDIS_ERRORS, REDIS_UNREACHABLE, OutageLog
from ..engine.tensor_parallel import ShardsLost
from ..speculation.acceptance import Candidates, NonFinite, Verdict, select_each
from ..speculation.sampling import make_generator
from ..speculation.tree import DraftTree
from ..store import RequestStore, StepState
from . import logprobs, metrics, preemption, stages
from .admission import Admission, Grant
from .constraint import GrammarViolation
from .runner import ModelRunner, describe
from .sequence import Committed, Sequence
from .speculator import Speculator
from .step_plan import StepPlan, plan_step

log = logging.getLogger(__name__)

STATUS_BY_REASON = {
    "FINISH_REASON_CANCELLED": "cancelled",
    "FINISH_REASON_ERROR": "failed",
    "FINISH_REASON_DEADLINE": "expired",
}


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        speculator: Speculator,
        store: RequestStore,
        admission: Admission,
        *,
        max_seq_len: int,
        max_prefill_tokens: int,
        eos_ids: set[int],
        decode: Callable[[list[int]], str],
        verifier_id: str = "",
        incarnation: str = "",
        served: dict[str, str] | None = None,
        max_failed_steps: int = 3,
        max_unread_tokens: int = 0,
        pause_timeout_seconds: float = 30.0,
        async_writes: bool = False,
        forced_drafts: bool = True,
    ):
        self.runner = runner
        self.speculator = speculator
        self.store = store
        self.admission = admission
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = eos_ids
        self.decode = decode
        self.verifier_id = verifier_id
        self.incarnation = incarnation  # with verifier_id, fences every write (store.py)
        # pool and model_version: on every step write and in every final
        self.served = served or {"pool": "", "model_version": ""}
        self.max_unread_tokens = max_unread_tokens  # 0: never pause
        self.pause_timeout_seconds = pause_timeout_seconds
        self.forced_drafts = forced_drafts  # a grammar's forced tokens are drafts
        self.running: dict[str, Sequence] = {}  # owned by the loop thread
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._cancel: dict[str, int] = {}  # request id -> step count when cancelled
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.steps = 0
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0  # steps in a row that failed for every sequence in them
        self._outage = OutageLog(log, "decode loop")
        self.tick = time.monotonic()  # when the loop last went round (the wedge check)
        # Why the model can compute no more steps (a tensor-parallel rank was lost), once the
        # loop has handed the requests back; on_lost is told then.
        self._lost: str | None = None
        self.on_lost: Callable[[str], None] = lambda _why: None
        # With async_writes, a step's tokens go to Redis on the writer's thread while the next
        # step computes; one write is in flight at most (`_send`, `_landed`).
        self._writer = ThreadPoolExecutor(1, "step-writer") if async_writes else None
        self._in_flight: tuple[Future, list[Sequence]] | None = None
        self._masking = ThreadPoolExecutor(1, "grammar")  # (constrained requests' masks)
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- called from RPC threads ----------------------------------------------------------
    def admit(self, seq: Sequence, grant: Grant) -> None:
        """Hands a sequence admitted with `grant` (and claimed) to the loop; it joins at the
        next step with the blocks its grant holds (a cached prefix among them)."""
        seq.generator = make_generator(seq.params, self.runner.model.device)  # where logits are
        seq.kv, seq.cached_tokens = grant.kv, grant.cached_tokens
        metrics.PREFIX_CACHE_TOKENS.inc(grant.cached_tokens)
        self._inbox.put(seq)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            found = request_id in self.running or any(
                s.request_id == request_id for s in list(self._inbox.queue)
            )
            self._cancel.setdefault(request_id, self.steps)
        return found

    def running_ids(self) -> list[str]:
        """The requests in the batch, and those admitted that join it at the next step."""
        with self._lock:
            joining = [s.request_id for s in list(self._inbox.queue)]
            return list(self.running) + joining

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    @property
    def lost(self) -> str | None:
        """Why no step can run here again (a tensor-parallel rank is gone), if so: known to
        the model at once, and to the loop once it has handed its requests back."""
        return self._lost or self.runner.lost()

    def alive(self, stall_seconds: float) -> bool:
        """False if the loop thread died or one round has taken over `stall_seconds`."""
        return self.thread.is_alive() and time.monotonic() - self.tick < stall_seconds

    def drain(self, grace_seconds: float) -> int:
        """Lets the running requests finish for up to `grace_seconds` (admission is closed
        by the caller), stops the loop, then hands what is left back to the queue with its
        progress. Returns how many were handed back."""
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and (self.running or not self._inbox.empty()):
            time.sleep(0.05)
        self.stop()
        return self._hand_back()

    def _hand_back(self) -> int:
        """Hands every request here back to the queue with its progress (the loop is not
        running); how many were."""
        self._take_new(block=False)
        try:
            self._landed()  # the write in flight, if any: its tokens count as written
        except Exception:
            log.exception("the last step write failed; its tokens are written again")
        handed = 0
        for seq in list(self.running.values()):
            try:
                self._flush([seq])
                handed += self.store.requeue(seq.request_id, self.verifier_id, self.incarnation)
            except Exception:  # the reaper requeues it once this verifier is gone
                log.exception("hand back failed", extra={"request_id": seq.request_id})
            self._drop(seq, "handed back")
        metrics.HANDED_BACK.inc(handed)
        return handed

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick = time.monotonic()
            if why := self.runner.lost():
                self._lose(why)
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
                self._lose(str(e))
                return
            except Exception as e:
                ok = False
                self._fail_running(e)
            self._outage.succeeded()
            if not ok:
                metrics.FAILED_STEPS.inc()
            self.failed_steps = 0 if ok else self.failed_steps + 1

    def _lose(self, why: str) -> None:
        """The model lost a rank: no step can run here again. The requests go back to the
        queue with what they emitted (another verifier goes on from there; the reaper
        requeues any this cannot hand back), and on_lost stops the verifier."""
        log.error("tensor-parallel group lost; handing the requests back", extra={"reason": why})
        self._lost = why
        self._hand_back()
        self.on_lost(why)

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
        try:
            seq = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if seq.restored:  # taken over: it may have ended with its last restored token
                self._finished(seq)
            with self._lock:
                self.running[seq.request_id] = seq
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> bool:
        """Plan, draft, verify, accept, emit: one forward pass for every running sequence.
        False when the step failed for every sequence in it."""
        self._resume()
        plan = self._plan()
        ok = True
        if plan.parts:
            with stages.step_span(plan) as span:
                trees = self._fit(plan, self._guide(plan, self._draft(plan, span)))
                masks = self._masks(plan, trees)  # (computed while the forward runs)
                logits = self._verify(plan, trees)
                ok = self._accept(plan, trees, logits, masks.result(), span)
        self.steps += 1
        metrics.STEPS.inc()
        self._emit(list(self.running.values()))
        return ok

    def _plan(self) -> StepPlan:
        """The step's sequences and what each feeds (step_plan.py). A deadline that passed
        ends its sequence at the end of the step (`_emit`)."""
        with self._lock:
            for seq in self.running.values():
                seq.cancelled |= seq.request_id in self._cancel
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

    def _guide(self, plan: StepPlan, trees: list[DraftTree]) -> list[DraftTree]:
        """The drafts of sequences with a grammar, shaped by it (constraint.py): where it
        forces the next tokens, they are the draft; else the tree less what it rules out."""
        guided = []
        for part, tree in zip(plan.parts, trees, strict=True):
            seq = part.seq
            if seq.constraint is not None and seq.speculate and not part.prefilling:
                left = min(seq.max_tokens, self.max_seq_len - len(seq.prompt_ids))
                try:
                    forced = None
                    if self.forced_drafts:
                        forced = seq.constraint.forced(left - len(seq.output_ids) - 1)
                    shaped = forced if forced is not None else seq.constraint.prune(tree)
                    seq.drafted += len(shaped) - len(tree)  # (what the target verifies)
                    tree = shaped
                except GrammarViolation:
                    pass  # (its masks say so, and end it)
            guided.append(tree)
        return guided

    def _masks(self, plan: StepPlan, trees: list[DraftTree]) -> Future:
        """Each part's grammar masks (None without a grammar, or for a prompt chunk that
        emits nothing), computed on a thread of their own: the grammar engine leaves the
        interpreter lock while it works, so they are ready when the forward pass is."""

        def masks() -> list[torch.Tensor | GrammarViolation | None]:
            found = []
            for part, tree in zip(plan.parts, trees, strict=True):
                try:
                    found.append(
                        part.seq.constraint.masks(tree)[0]
                        if part.seq.constraint is not None and part.complete
                        else None
                    )
                except GrammarViolation as e:
                    found.append(e)
            return found

        if not any(part.seq.constraint is not None for part in plan.parts):
            done: Future = Future()
            done.set_result([None] * len(plan.parts))
            return done
        return self._masking.submit(masks)

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

    def healthy(self) -> bool:
        """False once `max_failed_steps` steps in a row failed for every sequence in them:
        then the model, the device or the loop is broken, not one request."""
        return self.failed_steps < self.max_failed_steps

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
            levels = max(tree.depths()) + 1
            self.speculator.observe_acceptance(
                seq,
                tree,
                len(verdict.accepted),
                len(verdict.accepted) + (len(verdict.accepted) < levels),
            )
        seq.accepted += accepted
        seq.steps += 1
        stages.accepted(seq, len(tree), accepted, emitted)
        return accepted

    def _finished(self, seq: Sequence) -> str | None:
        return seq.check_finished(self.eos_ids, self.max_seq_len, self._tail_text)

    def _emit(self, seqs: list[Sequence]) -> None:
        """Writes new tokens to Redis in one round trip; retires the sequences that ended and
        drops those this verifier no longer owns. With async writes, it takes what the last
        step's write says (waiting for it only if it is still on its way), acts on that, and
        sends this step's, which travels while the next step computes: a sequence's state
        (cancelled, paused, no longer ours) and its end come a step later, and the tokens
        reach Redis as soon as before."""
        if self._writer is None:
            written = list(zip(seqs, self._flush(seqs), strict=True))
        else:
            written = [(s, st) for s, st in self._landed() if self.running.get(s.request_id) is s]
        for seq, state in written:
            if state == StepState.LOST:
                self._drop(seq, "lost: the request was requeued elsewhere")
                continue
            seq.cancelled |= state == StepState.CANCELLED
            if seq.end_if_paused(self.pause_timeout_seconds):
                metrics.UNREAD_ENDED.inc()
            if self._finished(seq) and seq.num_emitted == len(seq.output_ids):
                self._retire(seq)  # (with tokens still unwritten, after the next write)
        if self._writer is not None and self.running:
            self._send(list(self.running.values()))

    def _writes(self, seqs: list[Sequence]) -> tuple:
        """commit_step's arguments for each sequence's unwritten tokens (copied: the sequence
        goes on growing while an async write travels)."""
        return (
            self.verifier_id,
            [
                (s.request_id, s.num_emitted, s.output_ids[s.num_emitted :])
                + ((s.output_logprobs[s.num_emitted :],) if s.logprobs else ())
                for s in seqs
            ],
            self.served["model_version"],
            self.incarnation,
            self.max_unread_tokens,
        )

    def _send(self, seqs: list[Sequence]) -> None:
        """Starts an async write of the sequences' unwritten tokens (none is in flight)."""
        future = self._writer.submit(self.store.commit_step, *self._writes(seqs))
        self._in_flight = (future, seqs)

    def _landed(self) -> list[tuple[Sequence, StepState]]:
        """The sequences of the write in flight, if any, each with its state once the write
        is done (its Redis error is raised here: the tokens are sent again)."""
        if self._in_flight is None:
            return []
        future, seqs = self._in_flight
        self._in_flight = None
        return list(zip(seqs, self._apply(seqs, future.result()), strict=True))

    def _flush(self, seqs: list[Sequence]) -> list[StepState]:
        """Writes each sequence's unwritten tokens now (after any write in flight); per
        sequence the state commit_step returns. What Redis holds decides what counts as
        written: a failed write is sent again with the next step."""
        self._landed()
        return self._apply(seqs, self.store.commit_step(*self._writes(seqs)))

    def _apply(self, seqs: list[Sequence], results: list) -> list[StepState]:
        """What a write returned, per sequence: how far it is written, and whether it pauses
        or goes on."""
        states = []
        for seq, result in zip(seqs, results, strict=True):
            state, generated = result or (StepState.OK, seq.num_emitted)
            if state != StepState.LOST:
                seq.num_emitted = min(generated, len(seq.output_ids))
            if result is not None and seq.pause(state == StepState.PAUSED):
                log.info(
                    "paused: its client is not reading" if seq.paused_since else "resumed",
                    extra={"request_id": seq.request_id, "generated": seq.num_emitted},
                )
            states.append(state)
        metrics.PAUSED.set(sum(s.paused_since is not None for s in self.running.values()))
        return states

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
        owned = self.store.finish(
            seq.request_id,
            self.verifier_id,
            status,
            seq.final_info() | self.served,
            seq.queue,
            seq.session_id if seq.kv_kept else "",  # (a placement hint)
            self.incarnation,
        )
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

    def _drop(self, seq: Sequence, why: str) -> None:
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
        with self._lock:
            self.running.pop(seq.request_id, None)
            cancelled_at = self._cancel.pop(seq.request_id, None)
        return None if cancelled_at is None else self.steps - cancelled_at
