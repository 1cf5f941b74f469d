"""Small client-side helpers shared by the tests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

T = TypeVar("T")


@dataclass
class Result:
    chunks: list = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def final(self):
        return self.chunks[-1].final


def request(prompt_ids=None, prompt=None, max_tokens=16, **kw) -> generation_pb2.GenerateRequest:
    sampling = kw.pop("sampling", None) or common_pb2.SamplingParams()
    req = generation_pb2.GenerateRequest(max_tokens=max_tokens, sampling=sampling, **kw)
    if prompt_ids is not None:
        req.prompt_ids.ids.extend(prompt_ids)
    elif prompt is not None:
        req.prompt = prompt
    return req


def generate(stub, req, timeout: float = 120) -> Result:
    return Result(list(stub.Generate(req, timeout=timeout)))


def make_sequence(
    prompt: list[int], output: list[int] | None = None, max_tokens: int = 100, rid: str = "r"
):
    """A verifier Sequence for tests that drive the model pieces directly (greedy)."""
    from specserve.speculation.sampling import SamplingParams
    from specserve.verifier.sequence import Sequence

    return Sequence(
        request_id=rid,
        prompt_ids=list(prompt),
        max_tokens=max_tokens,
        params=SamplingParams(),
        stop=[],
        queue="interactive",
        entry_id="0-0",
        created_ms=0,
        admitted_ms=0,
        output_ids=list(output or []),
    )


def scrape(port: int) -> dict[str, float]:
    """A service's Prometheus metrics by series, e.g. 'name' or 'name{label="value"}'."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_until(check: Callable[[], T], what: str, timeout: float = 30, every: float = 0.05) -> T:
    """Polls `check` until it returns something true and returns that; fails the test naming
    `what` after `timeout` seconds (a wait that never ends is a failure, not a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(every)


@dataclass
class Client:
    """One greedy request seen from a client that re-attaches (same request_id, resume_from
    the next index) whenever its stream breaks: what arrived, when, and how often it
    re-attached."""

    rid: str
    prompt_ids: list[int]
    max_tokens: int = 400
    arrivals: list[tuple[float, int, list[int]]] = field(default_factory=list)
    final: generation_pb2.FinalInfo | None = None
    error: str = ""
    reattached: int = 0

    @property
    def received(self) -> int:
        return sum(len(ids) for _, _, ids in self.arrivals)

    def ids(self) -> list[int]:
        return [t for _, _, ids in sorted(self.arrivals, key=lambda a: a[1]) for t in ids]

    def indices(self) -> list[int]:
        """Every index that arrived, as often as it arrived."""
        return [first + k for _, first, ids in self.arrivals for k in range(len(ids))]

    def next_index(self) -> int:
        return max((first + len(ids) for _, first, ids in self.arrivals), default=0)

    def run(self, address: str, give_up_s: float = 240) -> None:
        """Generate; on a broken stream re-attach from the next index (Generate again if
        the request never reached the queue) until the final chunk arrives."""
        deadline = time.monotonic() + give_up_s
        submit = True  # until a try may have reached the queue, and again after NOT_FOUND
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            while time.monotonic() < deadline:
                if not submit:
                    req = generation_pb2.GenerateRequest(
                        request_id=self.rid, resume_from=self.next_index()
                    )
                else:
                    req = request(prompt_ids=self.prompt_ids, max_tokens=self.max_tokens)
                    req.request_id = self.rid
                submit = False
                try:
                    for chunk in stub.Generate(req, timeout=120):
                        if chunk.token_ids:
                            self.arrivals.append(
                                (time.monotonic(), chunk.first_index, list(chunk.token_ids))
                            )
                        if chunk.HasField("final"):
                            self.final = chunk.final
                            return
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        submit = True  # never accepted: submit it (again)
                    elif e.code() != grpc.StatusCode.UNAVAILABLE:
                        self.error = f"{e.code().name}: {e.details()}"
                        return
                self.reattached += 1
                time.sleep(0.3)  # a client's retry backoff: the event it waits for is its next try
            self.error = "gave up"


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(") ", 1)[-1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            found.append(int(entry.name))
    return found
