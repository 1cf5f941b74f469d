"""The proposer interface: given sequences' token histories, guess token trees for the
verifier to check. What crosses it: a `DraftJob` per sequence in, a `DraftTree` per job out;
a `TreeShape` bounds the trees a draft model grows, `DraftJob.budget` and
`DraftJob.free_budget` their nodes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from ..common.settings import DrafterSettings
from .tree import DraftTree


@dataclass
class DraftJob:
    """One sequence asking for a tree this step."""

    seq_id: str
    tokens: list[int]  # the whole accepted history: prompt + generated
    budget: int  # most nodes of a tree a draft model grows
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # for the random draws of sampling requests
    deep_budget: int | None = None  # most nodes of a model-free tree; None: `budget`
    tenant: str = ""  # whose earlier outputs may shape the drafts
    assumed: int = 0  # trailing tokens that are assumed, not accepted (run-ahead drafting)
    grammar: str = ""  # what the output (tokens[prompt_len:]) follows (llguidance's text)
    prompt_len: int = 0

    @property
    def free_budget(self) -> int:
        """Most nodes of a model-free tree (a suffix or n-gram match)."""
        return self.budget if self.deep_budget is None else self.deep_budget


@dataclass(frozen=True)
class TreeShape:
    max_depth: int = 6  # tree levels
    branching: int = 2  # children per expanded node
    width: int = 4  # nodes expanded per level
    min_path_prob: float = 0.0  # greedy only: a less likely path is not expanded


def shape_of(settings: DrafterSettings) -> TreeShape:
    return TreeShape(settings.max_depth, settings.branching, settings.width, settings.min_path_prob)


class Proposer(ABC):
    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: DrafterSettings) -> Proposer:
        """Builds the proposer (loading its model, if any) from the drafter's settings."""

    @abstractmethod
    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        """One tree per job, at most job.budget nodes each (maybe empty)."""

    @abstractmethod
    def forget(self, seq_id: str) -> None:
        """Frees whatever the proposer keeps for a sequence."""

    def propose_ahead(self, jobs: list[DraftJob]) -> list[DraftTree]:
        """Trees for histories that are assumptions (run-ahead drafting): like propose, but
        what the proposer learns from its own proposals must not count them."""
        return self.propose(jobs)

    def learn(self, tenant: str, tokens: list[int], prompt_len: int) -> None:
        """A sequence of `tenant` completed: its prompt (the first prompt_len tokens) and
        output. A proposer that drafts from earlier outputs keeps it; the others ignore it."""
        return None

    def learned_tokens(self) -> int:
        """Tokens of completed outputs the proposer keeps."""
        return 0

    def timed_cost(self) -> DraftCost | None:
        """What the proposer's draft model costs here, timed now; None without one."""
        return None


@dataclass(frozen=True)
class DraftCost:
    level_seconds: float  # one more level of a tree, one sequence
    catch_up_seconds_per_token: float  # context taken in before a sequence's first tree
