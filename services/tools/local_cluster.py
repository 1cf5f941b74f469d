"""Starts a whole cluster on this machine: a private redis-server, then the four services as
separate processes. Used by `specserve up` and by the tests."""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..common.settings import ModelRef
from ..store import acl
from .supervisor import RestartPolicy, Supervisor, log_to, supervise

START_ORDER = ("scheduler", "drafter", "verifier", "gateway")
# Settings that decide whether a verifier finds its drafter in the registry (see start).
DISCOVERY_KEYS = (
    "VERIFIER_DRAFTER_ADDRESSES",
    "VERIFIER_DISCOVER_DRAFTERS",
    "VERIFIER_POOL",
    "DRAFTER_POOL",
    "DRAFTER_ADVERTISE_ADDRESS",
)
REDIS = "redis"  # the private redis-server, as a member of the cluster
READY = re.compile(
    r"SPECSERVE_READY \w+ (\d+)(?: metrics (\d+))?(?: http (\d+))?(?: health (\d+))?"
)


def without_security(config: dict[str, Any]) -> dict[str, Any]:
    """The config with plaintext gRPC and no API keys: for benchmarks and tests that measure
    something else (development only)."""
    out = {section: dict(values or {}) for section, values in config.items()}
    out.setdefault("common", {})["insecure"] = True
    out.setdefault("gateway", {})["auth"] = "off"
    return out


PORTS_FROM = 20000  # free_port's lowest pick
_handed_out: set[int] = set()


def ephemeral_start() -> int:
    """The first port of the range the kernel gives outgoing connections (Linux's default where
    it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, for a service to bind later: a random one below the
    system's ephemeral range, not one the kernel picks (bind to 0). The kernel's picks come from
    the range outgoing connections take theirs from, and between the pick and the bind a
    client's connection once took the gateway's port (it failed to start: address in use)."""
    low = ephemeral_start()
    for _ in range(100):
        port = random.randrange(PORTS_FROM, max(low, PORTS_FROM + 1000))
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # (every pick taken: the kernel's)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    port: int = 0
    metrics_port: int | None = None
    http_port: int | None = None  # a gateway's OpenAI-compatible HTTP API
    health_port: int | None = None  # the plaintext probe port (health_port)
    service: str = ""  # gateway, scheduler, verifier or drafter
    env: dict[str, str] = field(default_factory=dict)  # what it was started with, to restart it
    log_offset: int = 0  # where this start's lines begin in the log (restarts append)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def ready(self) -> bool:
        """Whether this start printed its ready line; records the ports it bound."""
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(self.log_offset)
                m = READY.search(f.read())
        except OSError:
            return False
        if m:
            self.port = int(m.group(1))
            self.metrics_port = int(m.group(2)) if m.group(2) else None
            self.http_port = int(m.group(3)) if m.group(3) else None
            self.health_port = int(m.group(4)) if m.group(4) else None
        return m is not None


@dataclass
class LocalCluster:
    """A cluster of processes sharing one YAML config written to `workdir`."""

    config: dict[str, Any]
    workdir: Path
    redis_url: str | None = None
    redis_aof: bool = False  # persist every write (appendfsync always), as deployments do
    redis_password: str | None = None  # required by the private Redis (from a 0600 conf file)
    # The private Redis has a user per service (store/acl.py), each service connecting
    # as its own; redis_url is then the operator's (the `default` user, with a password).
    redis_users: bool = False
    procs: dict[str, Proc] = field(default_factory=dict)
    redis: subprocess.Popen | None = None
    redis_port: int = 0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "config.yaml"

    def start_redis(self) -> str:
        """Starts a private redis-server (on the port it had before, if restarted)."""
        if shutil.which("redis-server") is None:
            raise ClusterError(
                "redis-server is not installed (apt-get install redis-server), or pass --redis-url"
            )
        port = self.redis_port = self.redis_port or free_port()
        conf = self.workdir / "redis.conf"  # the password stays out of the process list
        conf.touch(mode=0o600)
        if self.redis_users:
            users = self.workdir / "redis-users"
            if not (users / "redis.conf").exists():  # (a restarted Redis keeps its users)
                self.redis_password = self.redis_password or secrets.token_hex(24)
                urls = acl.make_users(users, f"127.0.0.1:{port}", self.redis_password)
                for service in acl.SERVICES:
                    self.config.setdefault(service, {})["redis_url"] = urls[service]
            conf.write_text((users / "redis.conf").read_text())
        else:
            conf.write_text(f"requirepass {self.redis_password}\n" if self.redis_password else "")
        self.redis = subprocess.Popen(
            [
                "redis-server",
                str(conf),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.redis_aof else "no",
                "--appendfsync",
                "always",
                "--dir",
                str(self.workdir),
            ],
            stdout=open(self.workdir / "redis.log", "a"),
            stderr=subprocess.STDOUT,
        )
        auth = f":{self.redis_password}@" if self.redis_password else ""
        self.redis_url = f"redis://{auth}127.0.0.1:{port}/0"
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return self.redis_url
            time.sleep(0.05)
        raise ClusterError("redis-server did not start; see " + str(self.workdir / "redis.log"))

    def start(
        self, timeout: float = 600.0, gateway_port: int = 0, services: tuple[str, ...] = START_ORDER
    ) -> LocalCluster:
        _exit_on_sigterm()
        if self.redis_url is None:
            self.start_redis()
        common = self.config.setdefault("common", {})
        common["redis_url"] = self.redis_url
        self.config_path.touch(mode=0o600)  # it may hold credentials
        self.config_path.write_text(yaml.safe_dump(self.config))
        discovered = self._verifier_discovers_the_drafter(services)
        try:
            for name in services:
                env = {}
                if name == "gateway":
                    env["SPECSERVE_GATEWAY_SCHEDULER_ADDRESS"] = self.procs["scheduler"].address
                if name == "verifier" and "drafter" in services and not discovered:
                    if not self.config.get("verifier", {}).get("drafter_addresses"):
                        drafter = self.procs["drafter"].address
                        env["SPECSERVE_VERIFIER_DRAFTER_ADDRESSES"] = f'["{drafter}"]'
                port = gateway_port if name == "gateway" else 0
                wait = not (discovered and name == "drafter")  # (the verifier needs no address)
                self.start_service(name, env, port=port, wait=wait)
            for name in services:
                self.wait_ready(name, timeout)
            if discovered:
                self._wait_registered("drafter", self.procs["drafter"].port, timeout)
        except BaseException:  # a half-started cluster leaves nothing running behind
            self.stop()
            raise
        return self

    def _verifier_discovers_the_drafter(self, services: tuple[str, ...]) -> bool:
        """Whether the verifier finds the drafter in the registry (as it does on Kubernetes),
        so the two load their models side by side instead of the verifier waiting for the
        drafter's port: no drafter address is configured, discovery is on, one rollout pool,
        the drafter registers the address it binds, and no environment variable says other."""
        if "drafter" not in services or "verifier" not in services:
            return False
        verifier, drafter = self.config.get("verifier", {}), self.config.get("drafter", {})
        overridden = any(os.environ.get(f"SPECSERVE_{name}") for name in DISCOVERY_KEYS)
        return (
            not overridden
            and not verifier.get("drafter_addresses")
            and verifier.get("discover_drafters", True)
            and verifier.get("pool", "stable") == drafter.get("pool", "stable")
            and not drafter.get("advertise_address")
        )

    def _wait_registered(self, kind: str, port: int, timeout: float) -> None:
        """Waits until a member of `kind` serving on `port` is in the registry: verifiers
        see it from their next step on."""
        from ..store import RequestStore

        cluster = bool(self.config.get("common", {}).get("redis_cluster"))
        store = RequestStore.from_url(self.redis_url, cluster=cluster)
        deadline = time.monotonic() + timeout
        try:
            while not any(m.get("address", "").endswith(f":{port}") for m in store.live(kind)):
                if time.monotonic() > deadline:
                    raise ClusterError(f"no {kind} on port {port} registered after {timeout:.0f}s")
                time.sleep(0.05)
        finally:
            store.close()

    def start_service(
        self,
        name: str,
        env: dict[str, str] | None = None,
        port: int = 0,
        instance: str | None = None,
        wait: bool = True,
    ) -> Proc:
        """Starts a service; a scheduler or drafter (whose address others need) is waited
        for unless `wait` is False. Its log goes to `{instance}.log`, appended to."""
        key = instance or name
        log_path = self.workdir / f"{key}.log"
        cmd = [
            sys.executable,
            "-m",
            "specserve.tools.cli",
            "--config",
            str(self.config_path),
            "serve",
            name,
            "--port",
            str(port),
        ]
        with open(log_path, "a") as log_file:
            offset = log_file.tell()  # this start's lines begin here
            popen = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                start_new_session=True,
            )
        self.procs[key] = Proc(
            key, popen, log_path, port=port, service=name, env=dict(env or {}), log_offset=offset
        )
        if wait and name in ("scheduler", "drafter"):  # gateway and verifier need their addresses
            self.wait_ready(key, 600)
        return self.procs[key]

    def wait_ready(self, key: str, timeout: float) -> Proc:
        proc = self.procs[key]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.ready():
                return proc
            if proc.popen.poll() is not None:
                tail = "\n".join("  " + line for line in self.log_tail(key))
                raise ClusterError(
                    f"{key} could not start: exited with {proc.popen.returncode}. "
                    f"Its last log lines ({proc.log_path}):\n{tail}"
                )
            time.sleep(0.1)
        raise ClusterError(f"{key} not ready after {timeout:.0f}s; see {proc.log_path}")

    # A member is a service (by its key in `procs`) or the private Redis (REDIS).
    def members(self) -> list[str]:
        return [*self.procs, *([REDIS] if self.redis else [])]

    def _popen(self, key: str) -> subprocess.Popen:
        popen = self.redis if key == REDIS else self.procs[key].popen
        assert popen is not None
        return popen

    def pid(self, key: str) -> int:
        return self._popen(key).pid

    def exit_code(self, key: str) -> int | None:
        """None while the member runs."""
        return self._popen(key).poll()

    def address(self, key: str) -> str:
        return f"127.0.0.1:{self.redis_port}" if key == REDIS else self.procs[key].address

    def log_path(self, key: str) -> Path:
        return self.workdir / "redis.log" if key == REDIS else self.procs[key].log_path

    def log_tail(self, key: str, lines: int = 10) -> list[str]:
        """The last non-blank lines of a member's log, each cut to 300 characters."""
        try:
            text = self.log_path(key).read_text(errors="replace")
        except OSError:
            return []
        tail = [line for line in text.splitlines() if line.strip()][-lines:]
        return [line if len(line) <= 300 else line[:300] + " ..." for line in tail]

    def is_ready(self, key: str) -> bool:
        if key != REDIS:
            return self.procs[key].ready()
        with socket.socket() as s:
            return self.exit_code(key) is None and s.connect_ex(("127.0.0.1", self.redis_port)) == 0

    def restart(self, key: str) -> None:
        """Starts a member again on the port it had (others hold its address), without
        waiting for it: `is_ready` says when it serves."""
        if key == REDIS:
            try:
                self.start_redis()
            except ClusterError:
                pass  # it exited again: the supervisor sees that
            return
        proc = self.procs[key]
        env = dict(proc.env)
        if proc.http_port:  # (the HTTP API comes back on its port too)
            env["SPECSERVE_GATEWAY_HTTP_PORT"] = str(proc.http_port)
        self.start_service(proc.service, env, proc.port, instance=key, wait=False)

    def kill(self, key: str, sig: int = signal.SIGKILL) -> int:
        """Signals a service and waits for it to exit; returns its exit code."""
        proc = self.procs.pop(key)
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            proc.popen.wait(timeout=60)
        return proc.popen.returncode

    def kill_redis(self) -> None:
        """SIGKILLs the private redis-server (start_redis brings it back on its port)."""
        if self.redis and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait(timeout=30)

    def stop(self) -> None:
        for key in reversed(list(self.procs)):
            p = self.procs[key].popen
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for key in list(self.procs):
            p = self.procs[key].popen
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        if self.redis and self.redis.poll() is None:
            self.redis.terminate()
            self.redis.wait(timeout=10)


def _exit_on_sigterm() -> None:
    """The members run in sessions of their own (out of reach of the terminal's signals), so
    a process that started a cluster and died by SIGTERM (a `timeout`, a kill) left it running
    on the cores the next run times. Where SIGTERM still has its default action, in the main
    thread, it becomes SystemExit, as Ctrl-C becomes KeyboardInterrupt: the owner's `finally`
    (or a fixture's teardown) stops the cluster. `specserve up` has its own handler."""

    def exit_(signum, _frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, exit_)


def dev_key(cluster: LocalCluster) -> str | None:
    """A new key of tenant `dev` for the local cluster, unless its gateway runs without auth."""
    from ..common.settings import GatewaySettings
    from ..gateway.keys import KeyStore
    from ..store import RequestStore

    settings = GatewaySettings.load(cluster.config_path)
    if settings.auth == "off":
        return None
    store = RequestStore.from_url(cluster.redis_url)
    try:
        return KeyStore(store).create("dev", "standard", settings.tiers["standard"])
    finally:
        store.close()


def run_local_cluster(
    config_path: str | None, redis_url: str | None, port: int, policy: RestartPolicy | None = None
) -> int:
    """`specserve up`: start everything, print how to use it, restart what dies (see
    supervisor.py), stop it all on Ctrl-C or SIGTERM, or when a member crash-loops."""
    config = yaml.safe_load(Path(config_path).read_text()) if config_path else {}
    config = config or {}

    def interrupt(signum, _frame):
        raise KeyboardInterrupt

    # Ctrl-C and SIGTERM both stop the whole cluster (even where SIGINT arrived ignored).
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="specserve-"))
    ca = None
    if not (config.get("common") or {}).get("insecure"):  # mTLS with a fresh dev CA
        from ..common.tls import dev_tls_config, make_dev_certs

        paths = make_dev_certs(workdir / "certs")
        for section, values in dev_tls_config(paths).items():
            config[section] = {**(config.get(section) or {}), **values}
        ca = paths["ca"]
    # AOF: a restarted Redis comes back with every request in it.
    # A user per service on the private Redis (an operator's own Redis keeps its own users).
    cluster = LocalCluster(
        config, workdir, redis_url=redis_url, redis_aof=True, redis_users=redis_url is None
    )
    started = time.monotonic()
    print(f"starting the local cluster (logs in {workdir}) ...", flush=True)
    try:
        cluster.start(gateway_port=port)
        print_usage(cluster, ca, time.monotonic() - started)
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        log_to(workdir / "supervisor.log")
        failure = supervise(cluster, Supervisor(policy or RestartPolicy()), stop, say)
        if failure:
            print(f"error: {failure}", file=sys.stderr, flush=True)
            return 1
        print("\nstopping ...", flush=True)
        return 0
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def say(line: str) -> None:
    print(time.strftime("%H:%M:%S ") + line, flush=True)


def print_usage(cluster: LocalCluster, ca: Path | str | None, took: float) -> None:
    """The members (pid, address), the gateway, a dev key and commands to try."""
    for key in cluster.members():
        print(f"  {key:<10} pid {cluster.pid(key):<8} {cluster.address(key)}", flush=True)
    gateway = cluster.procs["gateway"].address
    key, env, flags, plain = dev_key(cluster), "", "", ""
    if key:
        env, flags = f"SPECSERVE_API_KEY={key} ", f"-H 'authorization: Bearer {key}' "
        print(f"\ndev API key (tenant dev): {key}", flush=True)
    if ca:
        env, flags = env + f"SPECSERVE_CA={ca} ", flags + f"-cacert {ca} "
        print(f"TLS on every port; the dev CA: {ca}", flush=True)
    else:
        flags += "-plaintext "
        plain = "--insecure " if key else ""  # (a key is sent in plaintext only if told)
    print(
        f"\nready in {took:.1f}s. gateway: {gateway}  redis: {cluster.redis_url}\n"
        f"try:  {env}"
        f'specserve generate --address {gateway} {plain}"Write a Python function that '
        'reverses a string."\n'
        f"  or: grpcurl {flags}"
        f'-d \'{{"prompt": "def fib(n):", "max_tokens": 32}}\' '
        f"{gateway} specserve.v1.GenerationService/Generate\n"
        + http_usage(cluster, key, ca)
        + "A member that dies is restarted on its port; Ctrl-C stops everything.",
        flush=True,
    )


def http_usage(cluster: LocalCluster, key: str | None, ca: Path | str | None) -> str:
    """How to call the gateway's OpenAI-compatible HTTP API: curl, and the openai client."""
    port = cluster.procs["gateway"].http_port
    if not port:
        return ""
    base = f"{'https' if ca else 'http'}://127.0.0.1:{port}/v1"
    model = cluster.config.get("gateway", {}).get("model", {}).get("name", ModelRef().name)
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi"}}], "stream": true}}'
    )
    flags = (f"--cacert {ca} " if ca else "") + (
        f"-H 'Authorization: Bearer {key}' " if key else ""
    )
    env = f"OPENAI_BASE_URL={base} OPENAI_API_KEY={key or 'none'} "
    return (
        f"  or: curl -N {flags}-H 'Content-Type: application/json' -d '{body}' "
        f"{base}/chat/completions\n"
        f"  or: {env}{f'SSL_CERT_FILE={ca} ' if ca else ''}python my_openai_script.py "
        f'(model="{model}")\n'
    )
