"""Keeps the local cluster running under `specserve up`: a member (a service or the private
redis-server) that exits unexpectedly is restarted on the port it had, after a backoff that
doubles with each quick failure; a member that keeps failing stops the cluster.

`Supervisor` is the policy alone (no processes, the clock passed in); `supervise` is the loop
that applies it to a `LocalCluster`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .local_cluster import LocalCluster

log = logging.getLogger("specserve.supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    """A member is restarted after `first_backoff` seconds, doubled for each exit in a row
    that came before it had run `stable_seconds`, up to `max_backoff`. Its `max_restarts`+1st
    such exit in a row is a crash loop: the cluster stops."""

    max_restarts: int = 5
    stable_seconds: float = 60.0
    first_backoff: float = 0.5
    max_backoff: float = 10.0


class Verdict(Enum):
    RESTART = "restart"
    GIVE_UP = "give up"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    attempt: int  # the restart this would be (1 for the first in a row)
    backoff: float  # seconds to wait before it


@dataclass
class _History:
    started: float
    quick_exits: int = 0  # exits in a row, each within stable_seconds of its start


@dataclass
class Supervisor:
    """The restart policy of the cluster's members. `started` when a member (re)starts,
    `exited` when it dies unexpectedly: restart it after the backoff, or give up."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    _members: dict[str, _History] = field(default_factory=dict)

    def started(self, member: str) -> None:
        history = self._members.setdefault(member, _History(self.clock()))
        history.started = self.clock()

    def exited(self, member: str) -> Decision:
        history = self._members.setdefault(member, _History(self.clock()))
        if self.clock() - history.started >= self.policy.stable_seconds:
            history.quick_exits = 0  # it had been up long enough: a fresh start
        history.quick_exits += 1
        attempt = history.quick_exits
        backoff = min(self.policy.first_backoff * 2 ** (attempt - 1), self.policy.max_backoff)
        verdict = Verdict.GIVE_UP if attempt > self.policy.max_restarts else Verdict.RESTART
        return Decision(verdict, attempt, backoff)


@dataclass
class _Pending:
    """A restart the loop owes a member: its start at `due`, then its readiness."""

    due: float
    spawned: bool = False


def supervise(
    cluster: LocalCluster,
    supervisor: Supervisor,
    stop: threading.Event,
    say: Callable[[str], None],
) -> str | None:
    """Watches every member of `cluster` until `stop` is set (returns None) or one crash-loops
    (returns why, with its last log lines). Restarts show through `say` and the log."""
    for key in cluster.members():
        supervisor.started(key)
    pending: dict[str, _Pending] = {}
    while not stop.wait(0.2):
        for key in _exited(cluster, pending):
            code = cluster.exit_code(key)
            decision = supervisor.exited(key)
            log.warning(
                "member exited",
                extra={
                    "member": key,
                    "exit_code": code,
                    "attempt": decision.attempt,
                    "backoff_s": decision.backoff,
                    "verdict": decision.verdict.value,
                },
            )
            if decision.verdict is Verdict.GIVE_UP:
                return crash_loop_message(cluster, supervisor, key, code)
            say(
                f"{key} (pid {cluster.pid(key)}) exited with {code}; restart {decision.attempt}"
                f" in {decision.backoff:g}s on {cluster.address(key)}"
            )
            pending[key] = _Pending(supervisor.clock() + decision.backoff)
        for key, restart in list(pending.items()):
            if not restart.spawned and supervisor.clock() >= restart.due:
                cluster.restart(key)
                supervisor.started(key)
                restart.spawned = True
            elif restart.spawned and cluster.is_ready(key):
                del pending[key]
                log.info("member back", extra={"member": key, "pid": cluster.pid(key)})
                say(f"{key} is back: pid {cluster.pid(key)} on {cluster.address(key)}")
    return None


def log_to(path: Path) -> None:
    """The supervisor's log: JSON lines in `path` (the members log to their own files)."""
    from ..common.telemetry import JsonFormatter

    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _exited(cluster: LocalCluster, pending: dict[str, _Pending]) -> list[str]:
    """Members that died and are not waiting for their backoff."""
    waiting = {k for k, p in pending.items() if not p.spawned}
    return [k for k in cluster.members() if k not in waiting and cluster.exit_code(k) is not None]


def crash_loop_message(
    cluster: LocalCluster, supervisor: Supervisor, key: str, code: int | None
) -> str:
    policy = supervisor.policy
    tail = "\n".join("  " + line for line in cluster.log_tail(key))
    return (
        f"{key} crash-loops: exited with {code} after {policy.max_restarts} restarts in a row, "
        f"none of them up {policy.stable_seconds:g}s; stopping the cluster. "
        f"Its last log lines ({cluster.log_path(key)}):\n{tail}"
    )
