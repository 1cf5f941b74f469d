"""`specserve up` keeps its cluster running: the restart policy with a fake clock, then the
real command as a subprocess, whose members are killed -9 one at a time mid-stream."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import cluster_config
from helpers import Client, wait_until
from specserve.tools.local_cluster import free_port
from specserve.tools.supervisor import Decision, RestartPolicy, Supervisor, Verdict
from specserve.verifier.reference import hf_greedy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_until_a_crash_loop_gives_up():
    clock = FakeClock()
    sup = Supervisor(RestartPolicy(max_restarts=5, stable_seconds=60), clock)
    sup.started("drafter")
    decisions = []
    for _ in range(6):
        clock.now += 3  # dies 3 s after each start
        decisions.append(sup.exited("drafter"))
        sup.started("drafter")
    assert decisions == [
        Decision(Verdict.RESTART, 1, 0.5),
        Decision(Verdict.RESTART, 2, 1.0),
        Decision(Verdict.RESTART, 3, 2.0),
        Decision(Verdict.RESTART, 4, 4.0),
        Decision(Verdict.RESTART, 5, 8.0),
        Decision(Verdict.GIVE_UP, 6, 10.0),  # backoff capped at max_backoff
    ]


def test_a_member_that_stayed_up_starts_afresh_and_members_are_apart():
    clock = FakeClock()
    sup = Supervisor(RestartPolicy(max_restarts=2, stable_seconds=60), clock)
    for member in ("verifier", "gateway"):
        sup.started(member)
    clock.now += 1
    assert sup.exited("verifier").attempt == 1
    sup.started("verifier")
    clock.now += 1
    assert sup.exited("verifier").attempt == 2
    assert sup.exited("gateway") == Decision(Verdict.RESTART, 1, 0.5)  # its own count
    sup.started("verifier")
    clock.now += 60  # up a whole minute: the next death is a first one again
    assert sup.exited("verifier") == Decision(Verdict.RESTART, 1, 0.5)
    sup.started("verifier")
    clock.now += 59.9
    assert sup.exited("verifier").attempt == 2
    sup.started("verifier")
    assert sup.exited("verifier").verdict is Verdict.GIVE_UP


# --- `specserve up` as a subprocess -------------------------------------------------------

MEMBER = re.compile(r"^  (\S+)\s+pid (\d+)\s+(\S+)$")
MAX_TOKENS = 400
PROMPTS = {
    "drafter": "def fibonacci(n):",
    "verifier": "class Stack:\n    def __init__(self):",
    "scheduler": "import os\nfor root, dirs, files in",
    "gateway": "SELECT name FROM users WHERE",
    "redis": "fn main() {\n    let v = vec![",
}


class Up:
    """`specserve up` running in a subprocess; its output is read line by line."""

    def __init__(self, tmp_path: Path, config: dict, *args: str) -> None:
        config_path = tmp_path / "up.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        cmd = [sys.executable, "-m", "specserve.tools.cli", "--config", str(config_path), "up"]
        self.popen = subprocess.Popen(
            [*cmd, "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # its logs land in tmp_path
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.lines.append("<eof>")
            self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        """The first line from `start` on matching `pattern`; fails on timeout or exit."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines[start:]:
                    if m := re.search(pattern, line):
                        return m
                assert "<eof>" not in self.lines, f"up exited:\n{self.output()}"
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} after {timeout}s:\n{self.output()}"
                self.changed.wait(left)

    def output(self) -> str:
        with self.changed:
            return "\n".join(self.lines)

    def exited(self, timeout: float) -> tuple[int, str]:
        """Its exit code, and all it printed (read to the end of its output)."""
        code = self.popen.wait(timeout=timeout)
        self.wait_for("<eof>", 30)
        return code, self.output()

    def members(self) -> dict[str, tuple[int, str]]:
        """What it printed at start: each member's pid and address."""
        return {m[1]: (int(m[2]), m[3]) for line in self.lines if (m := MEMBER.match(line))}

    def workdir(self) -> str:
        return self.wait_for(r"logs in (\S+)\)", 1)[1]

    def stop(self) -> None:
        """SIGTERM, if it still runs; its output shows with `pytest -s`."""
        print(self.output())
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            self.popen.wait(timeout=60)


def start_client(rid: str, prompt_ids: list[int], address: str) -> tuple[Client, threading.Thread]:
    client = Client(rid, prompt_ids, MAX_TOKENS)
    thread = threading.Thread(target=client.run, args=(address,), daemon=True)
    thread.start()
    return client, thread


def took(sock: socket.socket, port: int) -> bool:
    """Binds `sock` to the port; False while another process still holds it."""
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def left_running(workdir: str, pids: set[int]) -> list[str]:
    """Processes of the cluster still alive: any of `pids`, or any whose command line
    names the cluster's directory (its config or Redis dir)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if state != "Z" and (int(entry.name) in pids or workdir in cmdline):
            alive.append(f"{entry.name}: {cmdline}")
    return alive


@pytest.fixture
def up_config(tiny_model_dir):
    return cluster_config(
        tiny_model_dir,
        scheduler={"dead_verifier_grace_seconds": 0.5},
        verifier={"speculative_decoding": True, "draft_timeout_seconds": 1.0},
    )


@pytest.mark.cluster
def test_up_restarts_each_member_killed_mid_stream_and_loses_nothing(
    tmp_path, up_config, tiny_model, tokenizer
):
    up = Up(tmp_path, up_config)
    seen: set[int] = set()
    try:
        up.wait_for(r"ready in", 300)
        address = f"127.0.0.1:{up.port}"
        members = up.members()
        assert set(members) == {"scheduler", "drafter", "verifier", "gateway", "redis"}
        seen |= {pid for pid, _ in members.values()}
        for member, prompt in PROMPTS.items():
            ids = tokenizer(prompt).input_ids
            expected = hf_greedy(tiny_model, ids, MAX_TOKENS)
            streaming, t1 = start_client(f"up-{member}-1", ids, address)
            wait_until(lambda c=streaming: c.received >= 8, f"{member}: first tokens", 60)
            mark = len(up.lines)
            pid, member_address = members[member]
            os.kill(pid, signal.SIGKILL)
            at_kill = streaming.received
            after, t2 = start_client(f"up-{member}-2", ids, address)  # sent while it is down
            up.wait_for(rf"{member} \(pid {pid}\) exited with -9; restart 1 in", 30, mark)
            back = up.wait_for(rf"{member} is back: pid (\d+) on (\S+)", 120, mark)
            assert back[2] == member_address  # on the same port
            members[member] = (int(back[1]), back[2])
            seen.add(int(back[1]))
            for client, thread in ((streaming, t1), (after, t2)):
                thread.join(timeout=300)
                assert client.final, f"{member}: {client.rid} {client.error or 'hangs'}"
                indices = client.indices()
                assert sorted(indices) == list(range(MAX_TOKENS)), f"{member}: gap or repeat"
                assert client.ids() == expected, f"{member}: {client.rid} differs"
            assert 0 < at_kill < MAX_TOKENS, f"{member}: not mid-stream at the kill"
        workdir = up.workdir()
        supervisor_log = (Path(workdir) / "supervisor.log").read_text()
        assert supervisor_log.count('"msg": "member exited"') == len(PROMPTS)
        assert '"member": "verifier", "exit_code": -9, "attempt": 1' in supervisor_log
        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(timeout=60) == 0
        assert left_running(workdir, seen) == []
    finally:
        up.stop()


@pytest.mark.cluster
def test_up_stops_with_the_member_that_crash_loops(tmp_path, up_config):
    up = Up(tmp_path, up_config, "--max-restarts", "2")
    try:
        up.wait_for(r"ready in", 300)
        members = up.members()
        pid, address = members["verifier"]
        os.kill(pid, signal.SIGKILL)
        squatter = socket.socket()  # takes the verifier's port before it comes back
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = int(address.rsplit(":", 1)[1])
        wait_until(lambda: took(squatter, port), "the verifier's port freed", 10, every=0.01)
        squatter.listen()
        try:
            code, out = up.exited(timeout=240)
        finally:
            squatter.close()
        assert code == 1, out
        assert re.search(r"verifier crash-loops: exited with 1 after 2 restarts", out), out
        assert "Failed to bind to address" in out  # its last log lines say why
        assert left_running(up.workdir(), {pid for pid, _ in members.values()}) == []
    finally:
        up.stop()


@pytest.mark.cluster
def test_up_names_a_member_that_cannot_start(tmp_path, up_config):
    up_config["drafter"]["draft_model_path"] = str(tmp_path / "no-such-model")
    up = Up(tmp_path, up_config)
    try:
        code, out = up.exited(timeout=240)
        assert code == 1, out
        assert "error: drafter could not start: exited with 1" in out, out
        assert "no-such-model" in out
        assert left_running(up.workdir(), set()) == []
    finally:
        up.stop()
