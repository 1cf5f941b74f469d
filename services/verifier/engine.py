"""The verifier's decode loop: admit; then per step plan, draft, verify, accept, emit, retire.

One thread runs the loop; RPC handlers only hand it work through `admit` and `cancel`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import redis
import torch

from ..common.store import RequestStore
from ..common.tree import DraftTree
from . import metrics
from .acceptance import accept
from .runner import ModelRunner
from .sampling import make_generator
from .sequence import Sequence
from .speculator import Speculator

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        speculator: Speculator,
        store: RequestStore,
        *,
        batch_size: int,
        max_seq_len: int,
        eos_ids: set[int],
        decode: Callable[[list[int]], str],
    ):
        self.runner = runner
        self.speculator = speculator
        self.store = store
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.eos_ids = eos_ids
        self.decode = decode
        self.running: dict[str, Sequence] = {}  # owned by the loop thread
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self._reserved = 0  # admitted, not yet picked up by the loop
        self._cancel: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.steps = 0
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- called from RPC threads ----------------------------------------------------------
    def reserve(self) -> bool:
        """Takes a batch slot for an admission; False when the batch is full."""
        with self._lock:
            if len(self.running) + self._reserved >= self.batch_size:
                return False
            self._reserved += 1
            return True

    def unreserve(self) -> None:
        with self._lock:
            self._reserved -= 1

    def admit(self, seq: Sequence) -> None:
        """Hands a reserved, claimed sequence to the loop; it joins at the next step."""
        seq.generator = make_generator(seq.params)
        self._inbox.put(seq)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            found = request_id in self.running or any(
                s.request_id == request_id for s in list(self._inbox.queue)
            )
            self._cancel.add(request_id)
        return found

    def snapshot(self) -> tuple[int, list[str]]:
        with self._lock:
            ids = list(self.running)
            return len(ids) + self._reserved, ids

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take_new(block=not self.running)
            if self.running:
                try:
                    self.step()
                except redis.RedisError:
                    log.exception("redis error in step; retrying")
                    self._stop.wait(0.5)
                except Exception:  # a bug must not silently end the loop of every request
                    log.exception("step failed; retrying")
                    self._stop.wait(0.5)

    def _take_new(self, block: bool) -> None:
        try:
            seq = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            with self._lock:
                self.running[seq.request_id] = seq
                self._reserved -= 1
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        """Plan, draft, verify, accept, emit: one forward pass for every running sequence."""
        seqs = self._plan()
        if seqs:
            with metrics.DRAFT_SECONDS.time():
                trees = self.speculator.propose(seqs)
            try:
                with metrics.VERIFY_SECONDS.time():
                    logits = self.runner.verify(seqs, trees)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                log.exception("forward failed", extra={"requests": len(seqs)})
                for seq in seqs:
                    seq.finish_reason, seq.error = "FINISH_REASON_ERROR", f"forward failed: {e}"
            else:
                for seq, tree, rows in zip(seqs, trees, logits, strict=True):
                    self._accept(seq, tree, rows)
        self.steps += 1
        metrics.STEPS.inc()
        self._emit(list(self.running.values()))

    def _plan(self) -> list[Sequence]:
        """The sequences that take part in this step: running, not cancelled, not finished."""
        with self._lock:
            for seq in self.running.values():
                seq.cancelled |= seq.request_id in self._cancel
        return [s for s in self.running.values() if not s.cancelled and not s.finish_reason]

    def _accept(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> None:
        verdict = accept(tree, logits, seq.params, seq.generator)
        self.runner.commit(seq, tree, verdict.accepted)
        emitted = seq.extend(verdict.tokens, self._finished)
        accepted = min(len(verdict.accepted), emitted)
        seq.accepted += accepted
        seq.steps += 1
        metrics.DRAFTED_TOKENS.inc(len(tree))
        metrics.ACCEPTED_TOKENS.inc(accepted)
        metrics.ACCEPTED_LENGTH.observe(emitted)
        metrics.GENERATED_TOKENS.inc(emitted)

    def _finished(self, seq: Sequence) -> str | None:
        return seq.check_finished(self.eos_ids, self.max_seq_len, self._tail_text)

    def _emit(self, seqs: list[Sequence]) -> None:
        """Writes new tokens to Redis in one round trip; retires the sequences that ended."""
        progress = [
            (s.request_id, s.num_emitted, s.output_ids[s.num_emitted :])
            for s in seqs
            if len(s.output_ids) > s.num_emitted
        ]
        cancel_flags = self.store.commit_step(progress, [s.request_id for s in seqs])
        for seq, flagged in zip(seqs, cancel_flags, strict=True):
            seq.num_emitted = len(seq.output_ids)
            seq.cancelled |= flagged
            if self._finished(seq):
                self._retire(seq)

    def _tail_text(self, seq: Sequence) -> str:
        longest = max(len(s) for s in seq.stop)
        return self.decode(seq.output_ids[-(longest + 8) :])

    def _retire(self, seq: Sequence) -> None:
        status = {"FINISH_REASON_CANCELLED": "cancelled", "FINISH_REASON_ERROR": "failed"}.get(
            seq.finish_reason, "finished"
        )
        self.store.finish(seq.request_id, status, seq.final_info(), seq.queue, seq.entry_id)
        self.runner.release(seq)
        self.speculator.forget(seq)
        with self._lock:
            self.running.pop(seq.request_id, None)
            self._cancel.discard(seq.request_id)
        log.info(
            "request ended",
            extra={
                "request_id": seq.request_id,
                "status": status,
                "tokens": len(seq.output_ids),
                "steps": seq.steps,
            },
        )
