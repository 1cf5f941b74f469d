"""Small client-side helpers shared by the tests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from specserve.v1 import common_pb2, generation_pb2

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
    from specserve.verifier.sampling import SamplingParams
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
