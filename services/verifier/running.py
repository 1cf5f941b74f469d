"""The running batch: the sequences in it, those joining it, and which were cancelled.

RPC threads hand admitted sequences in (`join`), cancel requests (`cancel`) and list them
(`ids`); the loop's thread takes the joining ones in before a step (`take_new`) and removes
those that leave (`remove`). Only the loop's thread changes `running`; the lock guards what
RPC threads read and the cancellations they record.
"""

from __future__ import annotations

import queue
import threading

from .sequence import Sequence


class RunningBatch:
    def __init__(self):
        self.running: dict[str, Sequence] = {}  # by request id; the loop's thread changes it
        self._joining: queue.Queue[Sequence] = queue.Queue()
        self._cancelled: dict[str, int] = {}  # request id -> the engine's step when cancelled
        self._lock = threading.Lock()

    # --- called from RPC threads ----------------------------------------------------------
    def join(self, seq: Sequence) -> None:
        """Hands an admitted sequence to the loop; it joins at the next step."""
        self._joining.put(seq)

    def cancel(self, request_id: str, step: int) -> bool:
        """Marks a request cancelled at `step` (its sequence ends at the next step); whether
        it is here."""
        with self._lock:
            found = request_id in self.running or any(
                s.request_id == request_id for s in list(self._joining.queue)
            )
            self._cancelled.setdefault(request_id, step)
        return found

    def ids(self) -> list[str]:
        """The requests in the batch, and those admitted that join it at the next step."""
        with self._lock:
            joining = [s.request_id for s in list(self._joining.queue)]
            return list(self.running) + joining

    def idle(self) -> bool:
        """True if no sequence runs or waits to join."""
        return not self.running and self._joining.empty()

    # --- called from the loop's thread ------------------------------------------------------
    def take_new(self, block: bool) -> list[Sequence]:
        """Takes in the sequences waiting to join (with `block`, waiting up to 0.1 s for
        one); those it took."""
        taken = []
        try:
            seq = self._joining.get(timeout=0.1) if block else self._joining.get_nowait()
        except queue.Empty:
            return taken
        while True:
            with self._lock:
                self.running[seq.request_id] = seq
            taken.append(seq)
            try:
                seq = self._joining.get_nowait()
            except queue.Empty:
                return taken

    def mark_cancelled(self) -> None:
        """Sets `cancelled` on each running sequence whose request was cancelled."""
        with self._lock:
            for seq in self.running.values():
                seq.cancelled |= seq.request_id in self._cancelled

    def remove(self, seq: Sequence) -> int | None:
        """Removes the sequence from the batch; the step it was cancelled at, if it was."""
        with self._lock:
            self.running.pop(seq.request_id, None)
            return self._cancelled.pop(seq.request_id, None)
