"""Gets a draft tree for every running sequence each step: from a drafter over one
bidirectional stream, or, when the drafter fails, is late or its breaker is open, from the
fallback (no tree = plain decoding, or local n-gram drafts).

Owns what the drafter has been told: per sequence, how many tokens it has, per stream epoch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from ..common.settings import VerifierSettings
from ..common.tree import DraftTree, from_proto
from ..drafter.proposers import NgramProposer, TreeShape
from ..v1 import drafter_pb2, drafter_pb2_grpc
from . import metrics
from .sequence import Sequence

log = logging.getLogger(__name__)


class DraftUnavailable(Exception):
    """No usable answer from the drafter for this step."""


class DrafterClient:
    """A Speculate stream to one of the configured drafters, reopened on failure (next address).

    `epoch` changes whenever a new stream opens: the drafter behind it knows nothing yet."""

    def __init__(self, addresses: list[str], first: int = 0):
        self.addresses = addresses
        self._next = first % len(addresses)
        self.epoch = 0
        self.address = ""
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue | None = None
        self._responses: queue.Queue = queue.Queue()

    def exchange(self, request: drafter_pb2.DraftRequest, timeout: float):
        """Sends one step's request; returns the drafter's answer to it."""
        if self._requests is None:
            raise DraftUnavailable("stream not open")
        self._requests.put(request)
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DraftUnavailable(f"no drafts within {timeout:.2f}s") from None
            if isinstance(item, Exception):
                self.close()
                raise DraftUnavailable(f"drafter stream failed: {item}") from None
            if item.step == request.step:
                return item
            # an answer to an earlier step that missed its deadline: drop it

    def open(self) -> None:
        self.close()
        self.address = self.addresses[self._next]
        self._next = (self._next + 1) % len(self.addresses)
        self.epoch += 1
        self._channel = grpc.insecure_channel(self.address)
        requests: queue.Queue = queue.Queue()
        self._requests, self._responses = requests, queue.Queue()
        call = drafter_pb2_grpc.DrafterStub(self._channel).Speculate(iter(requests.get, None))
        threading.Thread(
            target=self._read, args=(call, self._responses), name="drafter-reader", daemon=True
        ).start()

    @staticmethod
    def _read(call, responses: queue.Queue) -> None:
        try:
            for response in call:
                responses.put(response)
            responses.put(ConnectionError("drafter closed the stream"))
        except grpc.RpcError as e:
            responses.put(ConnectionError(f"{e.code().name}: {e.details()}"))

    @property
    def is_open(self) -> bool:
        return self._requests is not None

    def close(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
            self._requests = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class CircuitBreaker:
    """Closed until `failures` consecutive failures; then open for `cooldown` seconds, after
    which one trial is allowed (half-open): success closes it, failure opens it again."""

    def __init__(self, failures: int, cooldown: float, clock=time.monotonic):
        self.threshold, self.cooldown, self.clock = failures, cooldown, clock
        self.failures = 0
        self.opened_at: float | None = None

    def allow(self) -> bool:
        return self.opened_at is None or self.clock() - self.opened_at >= self.cooldown

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            if self.opened_at is None:
                log.warning("drafter breaker open", extra={"failures": self.failures})
            self.opened_at = self.clock()


@dataclass
class _Synced:
    epoch: int
    length: int  # tokens of all_ids the drafter holds


class Speculator:
    def __init__(self, settings: VerifierSettings, vocab_size: int, client_index: int = 0):
        self.enabled = settings.speculative_decoding
        self.tree_size = settings.verification_tree_size
        self.timeout = settings.draft_timeout_seconds
        self.max_seq_len = settings.max_seq_len
        self.vocab_size = vocab_size
        self.client = (
            DrafterClient(settings.drafter_addresses, client_index)
            if self.enabled and settings.drafter_addresses
            else None
        )
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown_seconds)
        self.fallback = (
            NgramProposer(TreeShape(max_depth=8)) if settings.fallback_mode == "ngram" else None
        )
        self._synced: dict[str, _Synced] = {}
        self._finished: list[str] = []
        self._step = 0

    def budget(self, seq: Sequence) -> int:
        """Tree nodes to ask for: none when off, and never more than could be emitted.

        None on the prompt's prefill step either: the first token then does not wait for the
        drafter to prefill the prompt too (that happens with the second step)."""
        if not (self.enabled and seq.speculate) or seq.num_computed == 0:
            return 0
        size = self.tree_size if seq.tree_size is None else min(seq.tree_size, 256)
        generated = len(seq.output_ids)
        room = min(seq.max_tokens - generated, self.max_seq_len - len(seq.prompt_ids) - generated)
        return max(0, min(size, room - 1))

    def propose(self, seqs: list[Sequence]) -> list[DraftTree]:
        """One tree per sequence (empty: plain decoding for it this step)."""
        budgets = [self.budget(s) for s in seqs]
        if not any(budgets):
            return [DraftTree() for _ in seqs]
        trees = None
        if self.client is not None and self.breaker.allow():
            try:
                trees = self._ask_drafter(seqs, budgets)
                self.breaker.success()
            except DraftUnavailable as e:
                self.breaker.failure()
                log.warning("drafting failed; falling back", extra={"reason": str(e)})
        if trees is None:
            for seq, budget in zip(seqs, budgets, strict=True):
                seq.fallback_steps += budget > 0
                metrics.FALLBACK_STEPS.inc(budget > 0)
            trees = [self._fallback(seq, b) for seq, b in zip(seqs, budgets, strict=True)]
        for seq, tree in zip(seqs, trees, strict=True):
            seq.drafted += len(tree)
        return trees

    def forget(self, seq: Sequence) -> None:
        """The sequence ended: tell the drafter with the next message."""
        if self._synced.pop(seq.request_id, None) is not None:
            self._finished.append(seq.request_id)

    def _fallback(self, seq: Sequence, budget: int) -> DraftTree:
        if self.fallback is None or budget == 0:
            return DraftTree()
        return self.fallback.propose_one(seq.all_ids, budget)

    def _ask_drafter(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftTree]:
        client = self.client
        if not client.is_open:
            client.open()
        self._step += 1
        request = drafter_pb2.DraftRequest(step=self._step)
        for rid in self._finished:
            request.sequences.add(sequence_id=rid, finished=True)
        self._finished = []
        for seq, budget in zip(seqs, budgets, strict=True):
            synced = self._synced.get(seq.request_id)
            held = synced.length if synced and synced.epoch == client.epoch else 0
            ids = seq.all_ids
            delta = request.sequences.add(
                sequence_id=seq.request_id,
                new_token_ids=ids[held:],
                accepted_len=held,
                budget=budget,
                temperature=seq.params.temperature,
            )
            if seq.generator is not None:
                delta.draw_seed = int(torch.randint(2**62, (), generator=seq.generator))
            # Sent on an ordered stream: held even if this step's answer comes too late.
            self._synced[seq.request_id] = _Synced(client.epoch, len(ids))
        response = client.exchange(request, self.timeout)
        for rid in response.resync_ids:
            self._synced.pop(rid, None)
        by_id = {t.sequence_id: t for t in response.trees}
        trees = []
        for seq, budget in zip(seqs, budgets, strict=True):
            msg = by_id.get(seq.request_id)
            tree = from_proto(msg) if msg is not None else DraftTree()
            try:
                tree.validate(self.vocab_size)
                if len(tree) > budget:
                    raise ValueError(f"{len(tree)} nodes exceed the budget of {budget}")
            except ValueError as e:
                log.warning("bad draft tree dropped", extra={"reason": str(e)})
                tree = DraftTree()
            trees.append(tree)
        return trees

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
