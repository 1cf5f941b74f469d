"""How the engine's work here ends: drained at shutdown, or lost with a tensor-parallel rank.

`Lifecycle` owns why no step can run here again (`lost`) and who is told (`on_lost`). Either
way the requests in the batch are handed back to the queue with their progress: the write in
flight lands, each sequence's unwritten tokens are written, its request is requeued and the
sequence leaves the batch, so another verifier goes on from there (the reaper requeues any
this one cannot hand back, once it is gone).

- drain (SIGTERM): admission is closed by the caller; the batch gets a grace period to
  finish, then the loop stops and what is left is handed back.
- lost: the model lost a rank mid-step (or between steps); the loop hands everything back at
  once, stops, and `on_lost` stops the verifier, to be restarted as a group (ranks.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import metrics

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


class Lifecycle:
    """The end of an engine's work (its loop's thread calls `lose`; the server `drain`)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.on_lost: Callable[[str], None] = lambda _why: None
        self._lost: str | None = None  # set once the loop has handed the requests back

    @property
    def lost(self) -> str | None:
        """Why no step can run here again (a tensor-parallel rank is gone), if so: known to
        the model at once, and to the loop once it has handed its requests back."""
        return self._lost or self.engine.runner.lost()

    def drain(self, grace_seconds: float) -> int:
        """Lets the running requests finish for up to `grace_seconds` (admission is closed
        by the caller), stops the loop, then hands what is left back to the queue with its
        progress. Returns how many were handed back."""
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and not self.engine.batch.idle():
            time.sleep(0.05)
        self.engine.stop()
        return self.hand_back()

    def lose(self, why: str) -> None:
        """The model lost a rank: no step can run here again. The requests go back to the
        queue with what they emitted, and on_lost stops the verifier. (The loop's thread
        calls it, and then ends.)"""
        log.error("tensor-parallel group lost; handing the requests back", extra={"reason": why})
        self._lost = why
        self.hand_back()
        self.on_lost(why)

    def hand_back(self) -> int:
        """Hands every request here back to the queue with its progress (the loop is not
        running); how many were."""
        engine, writes = self.engine, self.engine.writes
        engine.batch.take_new(block=False)  # (those admitted but not yet in the batch, too)
        try:
            writes.landed()  # the write in flight, if any: its tokens count as written
        except Exception:
            log.exception("the last step write failed; its tokens are written again")
        handed = 0
        for seq in list(engine.running.values()):
            try:
                writes.flush([seq])
                handed += writes.requeue(seq)
            except Exception:  # the reaper requeues it once this verifier is gone
                log.exception("hand back failed", extra={"request_id": seq.request_id})
            engine.drop(seq, "handed back")
        metrics.HANDED_BACK.inc(handed)
        return handed
