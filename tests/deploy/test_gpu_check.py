"""`make gpu-check`'s wiring, on this machine: a stage past its limit is stopped together with
what it started, even in a session of its own; a stage that fails is recorded and the next one
runs; results.json says what ran. (On a GPU the same command runs with --device cuda.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_stages import GRACE_S, MARKER, Stage, run_stage

ROOT = Path(__file__).resolve().parents[2]


def marked(marker: str) -> list[str]:
    needle = f"{MARKER}={marker}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes():
                found.append(entry.name)
        except OSError:
            continue
    return found


def test_a_stage_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    # A process in a session of its own (as the cluster's services run) survives a signal to
    # the stage's process group; its marker finds it.
    command = ["sh", "-c", "setsid sleep 300 & echo started; sleep 300"]
    marker = f"test-{tmp_path.name}"
    record = run_stage(
        Stage("sleeper", command, 2), tmp_path, {"PATH": "/usr/bin:/bin"}, 60, marker, 1
    )
    assert record["status"] == "timed_out"
    assert record["seconds"] < 2 + GRACE_S
    assert record["processes_left_and_ended"] == 1
    assert marked(marker) == []
    assert "started" in (tmp_path / "sleeper.log").read_text()


def test_the_check_records_a_failed_stage_and_runs_the_next(tmp_path):
    """cuda:99 is a device no machine has: the environment stage fails on the settings' check
    (naming the key), and the tests stage still runs and passes."""
    test = "tests/unit/common/test_settings.py::test_settings_refuse_a_device_this_build_cannot_run"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cuda:99", "--budget", "240"]
        + ["--skip-bench", "--out", str(tmp_path), "--tests", test],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    stages = {s["name"]: s for s in results["stages"]}
    assert list(stages)[-2:] == ["environment", "tests"] and results["ok"] is False
    assert stages["environment"]["status"] == "failed"
    assert "verifier.device" in (tmp_path / "environment.log").read_text()
    assert stages["tests"]["status"] == "passed"
    assert stages["tests"]["summary"] | {"seconds": 0} == {
        "tests": 1,
        "failures": 0,
        "errors": 0,
        "skipped": 0,
        "seconds": 0,
        "failed": [],
    }
    assert "tests: passed" in run.stdout  # progress is printed as it goes
