"""A process that started a local cluster (a benchmark, a test run) and is killed with
SIGTERM stops the cluster's members, which run in sessions of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

OWNER = textwrap.dedent(
    """
    import signal, sys
    from pathlib import Path
    from conftest import cluster_config
    from specserve.tools.local_cluster import LocalCluster

    cluster = LocalCluster(cluster_config(None), Path(sys.argv[1]))
    try:
        cluster.start(timeout=120, services=("scheduler",))
        print(cluster.redis.pid, cluster.procs["scheduler"].popen.pid, flush=True)
        signal.pause()  # (until the test's SIGTERM)
    finally:
        cluster.stop()
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_cluster_owner_killed_with_sigterm_stops_its_members(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = owner.stdout.readline()  # (the members' pids, once the scheduler is ready)
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(map(alive, pids)), line
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=60) == 128 + signal.SIGTERM
        assert not any(map(alive, pids))  # (stopped and reaped by their owner)
    finally:
        if owner.poll() is None:
            owner.kill()
