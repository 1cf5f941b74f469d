"""The engine's writes to Redis: each step's new tokens, and a request's end or return.

`StepWrites` owns the write pipeline. Every step, each running sequence's tokens past its
`num_emitted` (with their log-probabilities) go to the store in one round trip
(`RequestStore.commit_step`), and what Redis answers is applied to the sequence: how far it
is written (`num_emitted`: what Redis holds decides, so a failed write is sent again with the
next step), and its state: it goes on, pauses (its client is `max_unread_tokens` behind), was
cancelled, or is no longer this verifier's (LOST: requeued while this one was thought dead).

With `async_step_writes`, a step's write travels on the writer's thread while the next step
computes: one write is in flight at most, and the engine acts on its answer a step later.

Every write is fenced by the `Owner` (verifier id and incarnation): one that no longer owns
the request changes nothing (store/ownership.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..common.settings import StreamSettings
from ..store import RequestStore, StepState
from . import metrics
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    """This verifier as the store knows it: every write is fenced by it."""

    verifier_id: str = ""
    incarnation: str = ""  # new at every start: see "Failures and recovery"
    pool: str = ""
    model_version: str = ""  # on every step write and in every final

    @property
    def served(self) -> dict[str, str]:
        """What a request's final entry says served it."""
        return {"pool": self.pool, "model_version": self.model_version}


class StepWrites:
    """The engine's writes to the store; the loop's thread calls it (a write in flight
    travels on a thread of its own)."""

    def __init__(
        self,
        store: RequestStore,
        owner: Owner,
        stream: StreamSettings,
        running: Mapping[str, Sequence],
    ):
        self.store = store
        self.owner = owner
        self.max_unread_tokens = stream.max_unread_tokens  # 0: never pause
        self._running = running  # the engine's batch (read only: whose answers still count)
        self._sender = ThreadPoolExecutor(1, "step-writer") if stream.async_step_writes else None
        self._in_flight: tuple[Future, list[Sequence]] | None = None

    # --- a step's write -----------------------------------------------------------------------
    def answered(self, seqs: list[Sequence]) -> list[tuple[Sequence, StepState]]:
        """The sequences a write answered this step, each with its state. Synchronous:
        `seqs`, written now. Asynchronous: those of the last step's write still in the batch
        (waiting for it only if it is still on its way), so a sequence's state (cancelled,
        paused, no longer ours) and its end come a step later."""
        if self._sender is None:
            return list(zip(seqs, self.flush(seqs), strict=True))
        return [(s, st) for s, st in self.landed() if self._running.get(s.request_id) is s]

    def send(self, seqs: list[Sequence]) -> None:
        """Asynchronous: starts the write of `seqs`' unwritten tokens, which travels while the
        next step computes (none is in flight: `answered` took it). Synchronous: nothing
        (`answered` wrote them)."""
        if self._sender is not None and seqs:
            future = self._sender.submit(self.store.commit_step, *self._step(seqs))
            self._in_flight = (future, seqs)

    def landed(self) -> list[tuple[Sequence, StepState]]:
        """The sequences of the write in flight, if any, each with its state once the write
        is done (its Redis error is raised here: the tokens are sent again)."""
        if self._in_flight is None:
            return []
        future, seqs = self._in_flight
        self._in_flight = None
        return list(zip(seqs, self._apply(seqs, future.result()), strict=True))

    def flush(self, seqs: list[Sequence]) -> list[StepState]:
        """Writes each sequence's unwritten tokens now (after any write in flight); per
        sequence the state commit_step returns."""
        self.landed()
        return self._apply(seqs, self.store.commit_step(*self._step(seqs)))

    # --- a request's last write -----------------------------------------------------------
    def finish(self, seq: Sequence, status: str) -> bool:
        """Ends the request with `status` and the sequence's final entry; a sequence whose
        blocks stay cached names its session's next verifier (this one). False if this
        verifier no longer owns it."""
        return self.store.finish(
            seq.request_id,
            self.owner.verifier_id,
            status,
            seq.final_info() | self.owner.served,
            seq.queue,
            seq.session_id if seq.kv_kept else "",  # (a placement hint)
            self.owner.incarnation,
        )

    def requeue(self, seq: Sequence) -> bool:
        """Hands the request back to its queue with what it emitted; False if it was not
        running here."""
        return self.store.requeue(seq.request_id, self.owner.verifier_id, self.owner.incarnation)

    # --- what a write sends, and what its answer does -----------------------------------------
    def _step(self, seqs: list[Sequence]) -> tuple:
        """commit_step's arguments for each sequence's unwritten tokens (copied: the sequence
        goes on growing while an async write travels)."""
        return (
            self.owner.verifier_id,
            [
                (s.request_id, s.num_emitted, s.output_ids[s.num_emitted :])
                + ((s.output_logprobs[s.num_emitted :],) if s.logprobs else ())
                for s in seqs
            ],
            self.owner.model_version,
            self.owner.incarnation,
            self.max_unread_tokens,
        )

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
        metrics.PAUSED.set(sum(s.paused_since is not None for s in self._running.values()))
        return states
