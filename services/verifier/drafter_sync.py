"""The sync protocol with the drafters: what each drafter's stream has been told, and the
message that tells it what changed since (ids and diffs, not state).

Per sequence: which drafter, which stream (epoch) and how many tokens it holds; per drafter,
the sequences that ended or moved away that it has not been told of yet."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from ..common import telemetry
from ..v1 import drafter_pb2
from .drafter_client import DrafterClient
from .sequence import Sequence


@dataclass
class _Synced:
    address: str
    epoch: int
    length: int  # tokens of all_ids the drafter holds


class DrafterSync:
    """What each drafter's stream holds, and the messages that bring it up to date."""

    def __init__(self):
        self._synced: dict[str, _Synced] = {}
        # drafter address -> what to tell it of sequences that ended or moved away
        self._finished: dict[str, list[drafter_pb2.SequenceDelta]] = {}
        self.step = 0
        self.largest_delta = 0  # most new tokens one sequence sent this step

    def next_step(self) -> int:
        """Starts a step's round of messages; its number is what the answers carry."""
        self.step += 1
        self.largest_delta = 0
        return self.step

    @property
    def has_finished(self) -> bool:
        """Some drafter holds state for a sequence that ended, and is to be told."""
        return bool(self._finished)

    def drafters_to_tell(self) -> list[str]:
        """The drafters that hold state for sequences that ended or moved away."""
        return list(self._finished)

    def drop_finished(self, address: str) -> None:
        """That drafter's stream is gone, and the state with it: nothing to tell."""
        del self._finished[address]

    def request(
        self,
        client: DrafterClient,
        seqs: list[Sequence],
        budgets: list[tuple[int, int]],
        drafters: Container[str],
    ) -> drafter_pb2.SpeculateRequest:
        """What changed for these sequences since this drafter's stream (open) last heard of
        them, with each one's (budget, deep budget); the other `drafters` still known are told
        of sequences that moved away."""
        request = drafter_pb2.SpeculateRequest(step=self.step, traceparent=telemetry.traceparent())
        request.sequences.extend(self._finished.pop(client.address, []))
        for seq, (budget, deep) in zip(seqs, budgets, strict=True):
            synced = self._synced.get(seq.request_id)
            moved = synced and synced.address != client.address
            if moved and synced.address in drafters:  # the old drafter forgets it
                self._tell(synced.address, seq.request_id)
            same = synced and synced.address == client.address and synced.epoch == client.epoch
            held = synced.length if same else 0
            ids = seq.all_ids
            self.largest_delta = max(self.largest_delta, len(ids) - held)
            delta = request.sequences.add(
                sequence_id=seq.request_id,
                new_token_ids=ids[held:],
                accepted_len=held,
                budget=budget,
                deep_budget=deep,
                temperature=seq.params.temperature,
            )
            if held == 0:
                delta.tenant, delta.prompt_len = seq.tenant, len(seq.prompt_ids)
                delta.grammar = seq.grammar
            if seq.generator is not None:
                gen = seq.generator
                delta.draw_seed = int(torch.randint(2**62, (), generator=gen, device=gen.device))
            # Sent on an ordered stream: held even if this step's answer comes too late.
            self._synced[seq.request_id] = _Synced(client.address, client.epoch, len(ids))
        return request

    def resynced(self, request_ids) -> None:
        """The drafter lost these sequences' state: the next message resends all of it."""
        for rid in request_ids:
            self._synced.pop(rid, None)

    def forget(self, seq: Sequence, completed: bool) -> None:
        """The sequence left this verifier: its drafter is told with the next message to it.
        One that `completed` comes with the tokens the drafter has not heard of: its whole
        output then shapes its tenant's drafts."""
        synced = self._synced.pop(seq.request_id, None)
        if synced is None:
            return
        tail = {}
        if completed:
            tail = {"new_token_ids": seq.all_ids[synced.length :], "accepted_len": synced.length}
        self._tell(synced.address, seq.request_id, completed=completed, **tail)

    def _tell(self, address: str, request_id: str, **ended) -> None:
        delta = drafter_pb2.SequenceDelta(sequence_id=request_id, finished=True, **ended)
        self._finished.setdefault(address, []).append(delta)
