"""One stage of `make gpu-check` (benchmarks/gpu_check.py): a subprocess with a time limit,
its output shown and logged, ended with everything it started, and summarised.

Standard library only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "SPECSERVE_GPU_CHECK_STAGE"  # every process a stage starts inherits it
GRACE_S = 20  # after SIGINT, for fixtures and `finally` blocks to stop their clusters
LEAST_S = 20  # a stage with less time than this left is skipped


@dataclass
class Stage:
    name: str
    command: list[str] | Callable[[], list[str]]  # a callable is called as the stage starts
    limit_s: float
    summarise: Callable[[str], dict] | None = None  # the stage's output -> its summary
    env: dict[str, str] = field(default_factory=dict)


def run_stage(stage: Stage, out: Path, env: dict, left_s: float, marker: str, number: int) -> dict:
    """Runs `stage` with at most `left_s` seconds; returns its record for results.json."""
    limit = min(stage.limit_s, left_s)
    record = {"name": stage.name, "limit_s": round(limit), "log": f"{stage.name}.log"}
    if left_s < LEAST_S:
        print(f"[gpu-check] {number} {stage.name}: skipped, {left_s:.0f} s of budget left")
        return record | {"status": "skipped", "reason": "budget spent"}
    env = {**env, **stage.env, MARKER: marker}
    command = stage.command() if callable(stage.command) else stage.command
    record["command"] = " ".join(command[:1] + [c if len(c) < 200 else "..." for c in command[1:]])
    print(f"[gpu-check] {number} {stage.name}: started, limit {limit:.0f} s", flush=True)
    started = time.monotonic()
    rc, timed_out, ended, output = watch(command, env, out / record["log"], limit, marker)
    seconds = round(time.monotonic() - started, 1)
    status = "timed_out" if timed_out else "passed" if rc == 0 else "failed"
    record |= {"status": status, "rc": rc, "seconds": seconds}
    if ended:
        record["processes_left_and_ended"] = ended
    if stage.summarise:
        try:
            record["summary"] = stage.summarise(output)
        except (OSError, ValueError, KeyError, ET.ParseError) as e:
            record["summary"] = {"error": f"{type(e).__name__}: {e}"}
    print(f"[gpu-check] {number} {stage.name}: {status} in {seconds} s (rc {rc})", flush=True)
    return record


def watch(
    command: list[str], env: dict, log_path: Path, limit: float, marker: str
) -> tuple[int, bool, int, str]:
    """Runs command, its output to the console and the log; past `limit` seconds it gets SIGINT,
    then SIGKILL after GRACE_S; then what it left running is ended. Returns (exit status,
    timed out, processes left and ended, output)."""
    lines: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group, to signal it whole
            # SIGINT as the default, also where the check itself runs with it ignored (started
            # in the background by a shell), so that the stop after the limit is graceful
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

        def copy() -> None:
            for line in proc.stdout:
                lines.append(line)
                log.write(line)
                log.flush()
                sys.stdout.write("  | " + line)
                sys.stdout.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        ended = end_marked(marker)  # before reading to the end: they may hold its output open
        reader.join(timeout=10)
        if timed_out:
            log.write(f"\n[gpu-check] stopped after its limit of {limit:.0f} s\n")
    return proc.returncode, timed_out, ended, "".join(lines)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def end_marked(marker: str) -> int:
    """SIGKILLs processes still running with this stage's marker in their environment (the
    services a cluster starts run in sessions of their own); returns how many."""
    needle = f"{MARKER}={marker}\0".encode()
    ended = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                ended += 1
        except (OSError, ProcessLookupError):
            continue
    return ended


class Summaries:
    """What each stage's record keeps of its output."""

    @staticmethod
    def probe(output: str) -> dict:
        for line in output.splitlines():
            if line.startswith("GPU_CHECK_JSON "):
                return json.loads(line.removeprefix("GPU_CHECK_JSON "))
        return {"error": "no environment line (see the log)"}

    @staticmethod
    def json_lines(output: str) -> dict:
        rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        return {"made": rows}

    @staticmethod
    def junit(path: str) -> Callable[[str], dict]:
        def summarise(_: str) -> dict:
            suite = ET.parse(path).getroot()
            suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
            failures = []
            for case in suite.iter("testcase"):
                problem = case.find("failure")
                problem = problem if problem is not None else case.find("error")
                if problem is not None:
                    message = (problem.get("message") or "").splitlines()
                    name = f"{case.get('classname')}::{case.get('name')}"
                    failures.append(f"{name}: {message[0][:300] if message else ''}")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            return counts | {"seconds": float(suite.get("time", 0)), "failed": failures}

        return summarise

    @staticmethod
    def bench(directory: Path, name: str | None = None) -> Callable[[str], dict]:
        """The JSON files the benchmark wrote (all of them, or `name`)."""

        def summarise(_: str) -> dict:
            files = [directory / name] if name else sorted(directory.glob("*.json"))
            return {f.name: json.loads(f.read_text()) for f in files if f.exists()}

        return summarise
