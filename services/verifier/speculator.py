"""Gets a draft tree for every running sequence each step: from the sequence's drafter over
that drafter's bidirectional stream, or, when the drafter fails, is late or its breaker is
open, from the fallback (no tree = plain decoding, or local n-gram drafts). The tree sizes come
from the policy (fixed, or adaptive).

Owns what each drafter has been told: per sequence, which drafter, which stream (epoch) and
how many tokens it holds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from ..common import telemetry, tls
from ..common.outage import REDIS_UNREACHABLE, OutageLog
from ..common.settings import VerifierSettings
from ..common.tree import DraftTree, from_proto
from ..drafter.proposers import NgramProposer, TreeShape
from ..v1 import drafter_pb2, drafter_pb2_grpc
from . import metrics
from .policy import AdaptivePolicy, Candidate
from .sequence import Sequence

log = logging.getLogger(__name__)


class DraftUnavailable(Exception):
    """No usable answer from the drafter for this step."""


class DrafterClient:
    """A Speculate stream to one drafter, opened on demand and reopened after a failure.

    `epoch` changes whenever a new stream opens: the drafter behind it knows nothing yet."""

    def __init__(self, address: str):
        self.address = address
        self.epoch = 0
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue | None = None
        self._responses: queue.Queue = queue.Queue()

    @property
    def is_open(self) -> bool:
        return self._requests is not None

    def send(self, request: drafter_pb2.DraftRequest) -> None:
        if self._requests is None:
            raise DraftUnavailable("stream not open")
        self._requests.put(request)

    def receive(self, step: int, deadline: float):
        """The drafter's answer to `step`, waiting until the monotonic `deadline`."""
        if self._requests is None:
            raise DraftUnavailable("stream not open")
        while True:
            try:
                item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DraftUnavailable("no drafts in time") from None
            if isinstance(item, Exception):
                self.close()
                raise DraftUnavailable(f"drafter stream failed: {item}") from None
            if item.step == step:
                return item
            # an answer to an earlier step that missed its deadline: drop it

    def open(self) -> None:
        self.close()
        self.epoch += 1
        self._channel = tls.channel(self.address)
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

    @property
    def is_open(self) -> bool:
        """Open and still cooling down: nothing goes through."""
        return not self.allow()

    def allow(self) -> bool:
        return self.opened_at is None or self.clock() - self.opened_at >= self.cooldown

    def half_open(self) -> None:
        """Lets a trial through now, as if the cooldown had passed (the drafter is back)."""
        if self.opened_at is not None:
            self.opened_at = self.clock() - self.cooldown

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            if self.opened_at is None:
                log.warning("drafter breaker open", extra={"failures": self.failures})
            self.opened_at = self.clock()


def registered_drafters(store, pool: str) -> dict[str, str]:
    """The live drafters of a rollout pool in the registry: address -> when that drafter
    process started (`started_ms`; "" if its entry does not say)."""
    return {
        d["address"]: d.get("started_ms", "")
        for d in store.live("drafter")
        if "address" in d and d.get("pool", "stable") == pool
    }


class DrafterPool:
    """The drafters one verifier streams with: the configured ones plus those registered in
    Redis (`discover`: address -> start time, refreshed every `refresh_seconds`), each with
    its own breaker.

    A sequence sticks to the drafter that holds its draft state while that drafter is usable;
    a new one (or one whose drafter failed or left) goes to the usable drafter with the fewest
    sequences, and resyncs there. A drafter that comes back (registered again after its entry
    was gone, or with a new start time: a restarted process) gets a trial at once instead of
    waiting out its breaker's cooldown."""

    def __init__(
        self,
        addresses: list[str],
        discover,
        breaker: tuple[int, float],
        refresh_seconds: float = 1.0,
        clock=time.monotonic,
    ):
        self.static = list(addresses)
        self.discover = discover
        self.breaker_args = breaker
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self.clients: dict[str, DrafterClient] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.assigned: dict[str, str] = {}  # sequence id -> drafter address
        self.registered: dict[str, str] = {}  # address -> start time, at the last discovery
        self._refreshed = -float("inf")
        self._outage = OutageLog(log, "drafter discovery")
        self._set(self.static)

    def refresh(self) -> None:
        if self.discover is None or self.clock() - self._refreshed < self.refresh_seconds:
            return
        self._refreshed = self.clock()
        try:  # the registry is an addition: without it, keep the drafters we have
            found = self.discover()
        except REDIS_UNREACHABLE as e:
            self._outage.failed(e)
            return
        except Exception as e:
            log.warning("drafter discovery failed", extra={"error": str(e)})
            return
        self._outage.succeeded()
        self._set(self.static + [a for a in found if a not in self.static])
        for address, started in found.items():
            back = self.registered.get(address) != started  # new, returned or restarted
            if back and address in self.breakers and self.breakers[address].is_open:
                log.info("drafter back; breaker half-open", extra={"address": address})
                self.breakers[address].half_open()
        self.registered = dict(found)

    def _set(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.clients:
                log.info("drafter added", extra={"address": address})
                self.clients[address] = DrafterClient(address)
                self.breakers[address] = CircuitBreaker(*self.breaker_args, clock=self.clock)
        for address in [a for a in self.clients if a not in addresses]:
            log.info("drafter removed", extra={"address": address})
            self.clients.pop(address).close()
            del self.breakers[address]
        metrics.DRAFTERS.set(len(self.clients))

    def assign(self, seq_id: str) -> str | None:
        """The drafter for a sequence this step; None if no drafter is usable."""
        current = self.assigned.get(seq_id)
        if current in self.clients and self.breakers[current].allow():
            return current
        usable = [a for a in self.clients if self.breakers[a].allow()]
        if not usable:
            return None
        load = {a: 0 for a in usable}
        for address in self.assigned.values():
            if address in load:
                load[address] += 1
        chosen = min(usable, key=lambda a: (load[a], usable.index(a)))
        self.assigned[seq_id] = chosen
        return chosen

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@dataclass
class _Synced:
    address: str
    epoch: int
    length: int  # tokens of all_ids the drafter holds


class Speculator:
    def __init__(self, settings: VerifierSettings, vocab_size: int, discover=None):
        self.enabled = settings.speculative_decoding
        self.tree_size = settings.verification_tree_size
        self.timeout = settings.draft_timeout_seconds
        self.max_seq_len = settings.max_seq_len
        self.vocab_size = vocab_size
        self.pool = (
            DrafterPool(
                settings.drafter_addresses,
                discover if settings.discover_drafters else None,
                (settings.breaker_failures, settings.breaker_cooldown_seconds),
            )
            if self.enabled
            else None
        )
        self.policy = (
            AdaptivePolicy(self.tree_size) if settings.speculation_policy == "adaptive" else None
        )
        self.fallback = (
            NgramProposer(TreeShape(max_depth=8)) if settings.fallback_mode == "ngram" else None
        )
        self._synced: dict[str, _Synced] = {}
        self._finished: dict[str, list[str]] = {}  # drafter address -> ended sequences
        self._step = 0
        self._largest_delta = 0  # most new tokens one sequence sent this step

    def cap(self, seq: Sequence) -> int:
        """Most tree nodes a sequence may get: none when off, and never more than could be
        emitted (so the KV reservation holds).

        None while the prompt is prefilled either: the first token then does not wait for the
        drafter to prefill the prompt too (that happens with the second step)."""
        if not (self.enabled and seq.speculate) or seq.prefilling:
            return 0
        size = self.tree_size if seq.tree_size is None else min(seq.tree_size, 256)
        generated = len(seq.output_ids)
        room = min(seq.max_tokens - generated, self.max_seq_len - len(seq.prompt_ids) - generated)
        return max(0, min(size, room - 1))

    def budgets(
        self, seqs: list[Sequence], other_tokens: int = 0, first_token: bool = False
    ) -> list[int]:
        """This step's tree size per sequence: its cap (fixed policy, or a pinned size), or
        what the adaptive policy chooses within it.

        On a step that gives an interactive request its first token (`first_token`), that
        token would wait for the drafts of the others: with at most one other sequence
        drafting, the adaptive policy drafts nothing (the draft time saved for the new request
        is worth about what one sequence's speculation gains in a step); with more, the
        others' loss outweighs it and they draft as usual."""
        caps = [self.cap(s) for s in seqs]
        if self.policy is None or not any(caps):
            return caps
        pinned = [s.tree_size is not None for s in seqs]
        if first_token and sum(cap > 0 for cap in caps) <= 1:
            return [cap if pin else 0 for cap, pin in zip(caps, pinned, strict=True)]
        return self.policy.budgets(
            [
                Candidate(cap, self.policy.alpha(s.accepted, s.tested), pin)
                for s, cap, pin in zip(seqs, caps, pinned, strict=True)
            ],
            other_tokens,
        )

    def observe_step(self, tokens: int, verify_seconds: float, prefill_tokens: int) -> None:
        """A step's forward pass took verify_seconds for `tokens` tokens. Only decode steps
        inform the cost model: the tree budget trades decode tokens, and a prompt chunk's
        tokens (long attention rows) cost more each than the nodes it would price."""
        if self.policy is not None and prefill_tokens == 0:
            self.policy.cost.observe_verify(tokens, verify_seconds)

    def observe_acceptance(self, seq: Sequence, accepted: int, tested: int) -> None:
        seq.tested += tested
        if self.policy is not None:
            self.policy.observe_acceptance(accepted, tested)

    def propose(
        self, seqs: list[Sequence], other_tokens: int = 0, first_token: bool = False
    ) -> list[DraftTree]:
        """One tree per sequence (empty: plain decoding for it this step); other_tokens are
        the step's prefill tokens, which the adaptive policy counts in the cost."""
        budgets = self.budgets(seqs, other_tokens, first_token)
        for budget in budgets:
            metrics.TREE_BUDGET.observe(budget)
        if not any(budgets) and not self._finished:  # (ended sequences free drafter state)
            return [DraftTree() for _ in seqs]
        trees: list[DraftTree | None] = [None] * len(seqs)
        if self.pool is not None:
            started = time.perf_counter()
            self._largest_delta = 0
            trees = self._ask_drafters(seqs, budgets)
            # Steady-state steps only: a drafter taking in a whole prompt (a new or moved
            # sequence) costs once, not per level, and would skew the per-level cost.
            steady = self._largest_delta <= self.tree_size + 1
            if self.policy is not None and steady and all(t is not None for t in trees):
                self.policy.cost.observe_draft(
                    max(budgets), sum(b > 0 for b in budgets), time.perf_counter() - started
                )
        for i, (seq, budget) in enumerate(zip(seqs, budgets, strict=True)):
            if trees[i] is None:
                seq.fallback_steps += budget > 0
                metrics.FALLBACK_STEPS.inc(budget > 0)
                trees[i] = self._fallback(seq, budget)
            seq.drafted += len(trees[i])
        return trees

    def forget(self, seq: Sequence) -> None:
        """The sequence ended: tell its drafter with the next message."""
        synced = self._synced.pop(seq.request_id, None)
        if synced is not None:
            self._finished.setdefault(synced.address, []).append(seq.request_id)
        if self.pool is not None:
            self.pool.assigned.pop(seq.request_id, None)

    def _fallback(self, seq: Sequence, budget: int) -> DraftTree:
        if self.fallback is None or budget == 0:
            return DraftTree()
        return self.fallback.propose_one(seq.all_ids, budget)

    def _ask_drafters(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftTree | None]:
        """Each sequence's tree from its drafter; None where that drafter failed, was late or
        none is usable. One message per drafter, all sent before any answer is awaited."""
        pool = self.pool
        pool.refresh()
        self._step += 1
        groups: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            address = pool.assign(seq.request_id)
            if address is not None:
                groups.setdefault(address, []).append(i)
        for address in list(self._finished):  # ended sequences free their drafter's caches
            client = pool.clients.get(address)
            if client is None or not client.is_open:  # that state is gone anyway
                del self._finished[address]
            elif address not in groups and pool.breakers[address].allow():
                groups[address] = []
        for address, members in groups.items():
            client = pool.clients[address]
            client.send(self._request(client, [seqs[i] for i in members], budgets, members))
        trees: list[DraftTree | None] = [None] * len(seqs)
        deadline = time.monotonic() + self.timeout
        for address, members in groups.items():
            try:
                response = pool.clients[address].receive(self._step, deadline)
            except DraftUnavailable as e:  # a stream error closed the stream; a late one stays
                pool.breakers[address].failure()
                log.warning(
                    "drafting failed; falling back", extra={"drafter": address, "reason": str(e)}
                )
                continue
            pool.breakers[address].success()
            for rid in response.resync_ids:
                self._synced.pop(rid, None)
            by_id = {t.sequence_id: t for t in response.trees}
            for i in members:
                trees[i] = self._checked(by_id.get(seqs[i].request_id), budgets[i])
        return trees

    def _request(
        self, client: DrafterClient, seqs: list[Sequence], budgets: list[int], members: list[int]
    ) -> drafter_pb2.DraftRequest:
        """What changed for these sequences since this drafter's stream last heard of them."""
        request = drafter_pb2.DraftRequest(step=self._step, traceparent=telemetry.traceparent())
        for rid in self._finished.pop(client.address, []):
            request.sequences.add(sequence_id=rid, finished=True)
        if not client.is_open:
            client.open()  # a new stream: the epoch moves on, every sequence resends it all
        for seq, i in zip(seqs, members, strict=True):
            synced = self._synced.get(seq.request_id)
            moved = synced and synced.address != client.address
            if moved and synced.address in self.pool.clients:  # the old drafter forgets it
                self._finished.setdefault(synced.address, []).append(seq.request_id)
            same = synced and synced.address == client.address and synced.epoch == client.epoch
            held = synced.length if same else 0
            ids = seq.all_ids
            self._largest_delta = max(self._largest_delta, len(ids) - held)
            delta = request.sequences.add(
                sequence_id=seq.request_id,
                new_token_ids=ids[held:],
                accepted_len=held,
                budget=budgets[i],
                temperature=seq.params.temperature,
            )
            if seq.generator is not None:
                delta.draw_seed = int(torch.randint(2**62, (), generator=seq.generator))
            # Sent on an ordered stream: held even if this step's answer comes too late.
            self._synced[seq.request_id] = _Synced(client.address, client.epoch, len(ids))
        return request

    def _checked(self, msg, budget: int) -> DraftTree:
        tree = from_proto(msg) if msg is not None else DraftTree()
        try:
            tree.validate(self.vocab_size)
            if len(tree) > budget:
                raise ValueError(f"{len(tree)} nodes exceed the budget of {budget}")
        except ValueError as e:
            log.warning("bad draft tree dropped", extra={"reason": str(e)})
            tree = DraftTree()
        return tree

    def _failed(self, address: str, error: Exception) -> None:
        self.pool.breakers[address].failure()
        self.pool.clients[address].close()
        log.warning(
            "drafting failed; falling back", extra={"drafter": address, "reason": str(error)}
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
