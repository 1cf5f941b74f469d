"""The ranks of a tensor-parallel verifier (`verifier.tensor_parallel: N`, N > 1).

Rank 0 is the verifier process: gRPC, Redis, scheduling and acceptance are its alone. It
launches ranks 1..N-1 itself, as child processes of its own (`python -m specserve.verifier.ranks`),
one device each (cuda:k+r for rank r when the verifier is on cuda:k; the CPU for all on the
CPU). They meet at a TCP store rank 0 opens on the loopback, load their own shards, and then
run each step rank 0 sends them (FlatModel.follow).

Why a launcher of our own and not torchrun: the group is one unit of failure. Rank 0 sees a
rank exit the moment it does (it is the rank's parent), ends the group and exits non-zero,
and the ranks die with it (PR_SET_PDEATHSIG), so whatever restarts the verifier (kubelet,
`specserve up`) restarts all N together; there is no half-alive verifier, and nothing
between the pod and the ranks to configure. The same command runs a verifier of any N in
the local cluster, the tests and a pod.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine import models
from ..engine.tensor_parallel import Shards, rank_devices

log = logging.getLogger(__name__)

WATCH_SECONDS = 0.2  # how often rank 0 looks at its ranks' processes
# A rank lost while rank 0's decode loop waits in an exchange that may not fail soon (NCCL
# work is asynchronous): after this long the watcher stops the verifier itself.
STUCK_SECONDS = 10.0
LOAD_SECONDS = 300.0  # the least time the ranks get to load their shards after rank 0 has
PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # (resolved here: not in a forked child)


class RanksFailed(RuntimeError):
    """The ranks could not start or meet; the message says which and why."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to load and run its shard (sent on its command line)."""

    path: str  # the model directory
    dtype: str
    device: str  # rank 0's device: rank r runs on rank_devices(device, world)[r]
    world: int
    port: int  # the TCP store rank 0 opened on 127.0.0.1
    timeout_s: float
    threads: int  # torch threads per rank; 0: torch's default
    compile: bool
    attention: str
    log_level: str


class Ranks:
    """Ranks 1..N-1 of this verifier, launched and watched by rank 0 (this process)."""

    def __init__(self, spec: RankSpec, store: dist.TCPStore, procs: list[subprocess.Popen]):
        self.spec = spec
        self.store = store
        self.procs = procs  # procs[i] is rank i + 1
        self.shards: Shards | None = None
        self._closed = threading.Event()

    @classmethod
    def launch(cls, path: Path, settings) -> Ranks:
        """Starts the other ranks and joins the group with them; RanksFailed if one exits or
        they have not all joined within verifier.tensor_parallel_timeout_seconds."""
        world, timeout_s = settings.tensor_parallel, settings.tensor_parallel_timeout_seconds
        store = dist.TCPStore(
            "127.0.0.1", 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        spec = RankSpec(
            path=str(path),
            dtype=settings.dtype,
            device=settings.device,
            world=world,
            port=store.port,
            timeout_s=timeout_s,
            threads=settings.torch_threads,
            compile=settings.compile,
            attention=settings.attention,
            log_level=settings.log_level,
        )
        command = [sys.executable, "-m", "specserve.verifier.ranks"]
        parent = os.getpid()
        procs = [
            _spawn([*command, str(rank), json.dumps(asdict(spec))], parent)
            for rank in range(1, world)
        ]
        ranks = cls(spec, store, procs)
        try:
            ranks._wait_for("joined", timeout_s)
            device = rank_devices(spec.device, world, torch.cuda.device_count())[0]
            ranks.shards = Shards.join(store, 0, world, device, timeout_s)
        except BaseException:
            ranks.close(clean=False)
            raise
        log.info("tensor-parallel ranks joined", extra={"ranks": world, "port": spec.port})
        return ranks

    def loaded(self) -> dict[int, int]:
        """Waits (once rank 0 has loaded its own shard: they load at the same time) for every
        rank to have loaded its shard, for the timeout or LOAD_SECONDS, whichever is longer;
        its weights' bytes, by rank."""
        self._wait_for("loaded", max(self.spec.timeout_s, LOAD_SECONDS))
        return {r: int(self.store.get(f"loaded/{r}")) for r in range(1, self.spec.world)}

    def _wait_for(self, stage: str, timeout_s: float) -> None:
        """Until every rank has set `stage`/its rank in the store. A rank that exits first
        fails the start at once; one that never gets there, after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        waiting = list(range(1, self.spec.world))
        while waiting:
            if exited := self.exited():
                raise RanksFailed(f"tensor-parallel {exited} before it {stage}")
            waiting = [r for r in waiting if not self.store.check([f"{stage}/{r}"])]
            if waiting and time.monotonic() > deadline:
                raise RanksFailed(
                    f"tensor-parallel rank(s) {', '.join(map(str, waiting))} of "
                    f"{self.spec.world} not {stage} within {timeout_s:g} s "
                    "(verifier.tensor_parallel_timeout_seconds)"
                )
            time.sleep(0.05)

    def exited(self) -> str | None:
        """Which rank exited, and how, if one did."""
        for rank, proc in enumerate(self.procs, start=1):
            if (code := proc.poll()) is not None:
                return f"rank {rank} exited ({describe_exit(code)})"
        return None

    def watch(self, on_stuck: Callable[[str], None]) -> None:
        """While serving: a rank that exits marks the group lost, and the decode loop hands
        its requests back and stops the verifier; if that has not happened within
        STUCK_SECONDS, `on_stuck` is called (the loop waits in an exchange)."""

        def run() -> None:
            while not self._closed.wait(WATCH_SECONDS):
                if (exited := self.exited()) is not None:
                    self.shards.lost = self.shards.lost or exited
                    log.error("tensor-parallel rank lost", extra={"reason": exited})
                    if not self._closed.wait(STUCK_SECONDS):
                        on_stuck(exited)
                    return

        threading.Thread(target=run, name="ranks", daemon=True).start()

    def close(self, clean: bool = True) -> None:
        """Stops the ranks: asked to while the group works and nothing else uses it (`clean`),
        else (or if they do not stop within 10 s) killed."""
        self._closed.set()
        if exited := self.exited():
            log.error("tensor-parallel rank lost", extra={"reason": exited})
        asked = False
        if clean and self.shards is not None and self.shards.lost is None:
            try:
                self.shards.send(None)
                asked = True
            except Exception:
                log.warning("tensor-parallel ranks did not take the stop; killing them")
        elif self.shards is not None and self.shards.lost is None:
            self.shards.lost = "stopped while in use"
        for proc in self.procs:
            try:
                proc.wait(timeout=10 if asked else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.shards is not None:
            self.shards.close()


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _spawn(command: list[str], parent: int) -> subprocess.Popen:
    """Starts a rank from a thread that stays for the process's life. PR_SET_PDEATHSIG kills
    a child when the thread that started it ends, not the process, and rank 0 launches its
    ranks while it is built, on a thread that ends then (service.in_own_thread)."""
    started: Future = Future()

    def run() -> None:
        try:
            started.set_result(subprocess.Popen(command, preexec_fn=lambda: _die_with(parent)))
        except BaseException as e:  # (raised on the caller's thread)
            started.set_exception(e)
        threading.Event().wait()  # for good: this thread's end would kill the rank

    threading.Thread(target=run, name="rank-parent", daemon=True).start()
    return started.result()


def _die_with(parent: int) -> None:
    """In a rank, before it runs: the kernel kills it when rank 0 dies (PR_SET_PDEATHSIG); if
    rank 0 died already (before the call), it goes now."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def follow(rank: int, spec: RankSpec) -> int:
    """A rank other than 0: join, load this rank's shard, run rank 0's steps until it stops."""
    from ..engine.compiler import Compiler
    from ..engine.flat_model import FlatModel

    models.set_host_threads(spec.threads, spec.device, "verifier.torch_threads")
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world, False, timeout)
    store.set(f"joined/{rank}", "1")
    device = rank_devices(spec.device, spec.world, torch.cuda.device_count())[rank]
    shards = Shards.join(store, rank, spec.world, device, spec.timeout_s)
    model = models.load_model(
        Path(spec.path), device, spec.dtype, setting="verifier.dtype", shard=(rank, spec.world)
    )
    store.set(f"loaded/{rank}", str(models.weight_bytes(model)))
    flat = FlatModel(
        model,
        compiler=Compiler() if spec.compile else None,
        shards=shards,
        attention=spec.attention,
    )
    try:
        flat.follow()
    finally:
        shards.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description="One rank (not 0) of a tensor-parallel verifier. Rank 0, the verifier "
        "(`specserve serve verifier` with verifier.tensor_parallel > 1), starts these itself."
    )
    parser.add_argument("rank", type=int)
    parser.add_argument("spec", help="RankSpec as JSON")
    args = parser.parse_args()
    from ..common import telemetry

    spec = RankSpec(**json.loads(args.spec))
    telemetry.setup(f"verifier-rank-{args.rank}", spec.log_level)
    try:
        return follow(args.rank, spec)
    except Exception:
        log.exception("tensor-parallel rank failed", extra={"rank": args.rank})
        return 1


if __name__ == "__main__":
    sys.exit(main())
