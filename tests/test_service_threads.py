"""A service's build runs on a thread that ends with it (common/service.in_own_thread), so
that the OpenMP team its model work starts goes with it and the engine thread's is the
process's only one (with two, libgomp's idle workers sleep between ops: a decode step waited
on their waking)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from specserve.common.service import in_own_thread

# In a fresh interpreter: the process's thread count before and after one parallel torch op,
# run on the main thread or through in_own_thread.
# (The workers of a thread that ended exit on their own time: the count is read until it is
# back, for up to 10 s; the main thread's stay.)
COUNT = """
import os, sys, time, torch
from specserve.common.service import in_own_thread
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
