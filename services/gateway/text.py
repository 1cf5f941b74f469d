"""Incremental detokenization and stop-string trimming for streamed text."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Decodes a short window (prefix_offset..end) and emits only what follows the window's
    already-emitted part; a delta ending in U+FFFD (an incomplete UTF-8 sequence) waits.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]


class StopTrimmer:
    """Holds back the text that could be the start of a stop string; cuts at the first stop."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buffer += text
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.buffer = self.buffer[: min(hits)], ""
            return out
        cut = max(0, len(self.buffer) - self.hold)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
