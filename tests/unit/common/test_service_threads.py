"""A process's model work on one thread: a service's build runs on a thread that ends with it
(common/service.in_own_thread), so that the OpenMP team its model work starts goes with it
and the engine thread's is the process's only one (with two, libgomp's idle workers sleep
between ops: a decode step waited on their waking); a drafter drafts on one thread whichever
gRPC thread serves the stream."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from specserve.common.service import in_own_thread
from specserve.common.settings import DrafterSettings
from specserve.drafter.server import DrafterService
from specserve.speculation.ngram import NgramProposer
from specserve.v1 import drafter_pb2

# In a fresh interpreter: the process's thread count before and after one parallel torch op,
# run on the main thread or through in_own_thread.
# (The workers of a thread that ended exit on their own time: the count is read until it is
# back, for up to 10 s; the main thread's stay.)
COUNT = """
import os, sys, time, torch
from specserve.speculation.ngram import NgramProposer
from specserve.common.service import in_own_thread
from specserve.common.settings import DrafterSettings
from specserve.drafter.server import DrafterService
from specserve.v1 import drafter_pb2
torch.set_num_threads(2)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
work = lambda: (torch.randn(1500, 1500) @ torch.randn(1500, 1500)).sum().item()
work() if sys.argv[1] == "main" else in_own_thread(work)
deadline = time.monotonic() + 10
while sys.argv[1] != "main" and threads() != before and time.monotonic() < deadline:
    time.sleep(0.05)
print(before, threads())
"""


def test_the_result_comes_back_from_another_thread():
    assert in_own_thread(lambda a, b: (a + b, threading.current_thread().name), 2, 3) == (
        5,
        "build",
    )


def test_an_exception_is_raised_on_the_callers_thread():
    def fails():
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        in_own_thread(fails)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_the_openmp_workers_a_build_starts_end_with_it():
    def counts(where: str) -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", COUNT, where], capture_output=True, text=True, check=True
        )
        before, after = map(int, out.stdout.split())
        return before, after

    before, after = counts("main")
    assert after > before  # the control: the main thread keeps a worker after its op
    before, after = counts("own-thread")
    assert after == before


def test_a_drafter_drafts_on_one_thread_whichever_thread_serves_its_stream():
    """Streams served on two gRPC threads draft on the drafter's one model thread (a second
    OpenMP team in the process would slow every draft)."""
    proposer = NgramProposer.from_settings(DrafterSettings())
    drafted_on: list[str] = []
    propose = proposer.propose

    def recorded(jobs):
        drafted_on.append(threading.current_thread().name)
        return propose(jobs)

    proposer.propose = recorded
    service = DrafterService(proposer)

    def stream(seq_id: str) -> None:
        delta = drafter_pb2.SequenceDelta(
            sequence_id=seq_id, new_token_ids=[5, 6, 7, 5, 6], accepted_len=0, budget=3
        )
        response, _ = service.answer(drafter_pb2.SpeculateRequest(step=1, sequences=[delta]), {})
        assert [t.sequence_id for t in response.trees] == [seq_id]

    for seq_id in ("a", "b"):  # each on a thread of its own, as two gRPC threads would
        thread = threading.Thread(target=stream, args=(seq_id,))
        thread.start()
        thread.join()
    assert len(drafted_on) == 2 and drafted_on[0] == drafted_on[1]
    assert drafted_on[0].startswith("draft-model")
