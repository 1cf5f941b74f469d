"""A real local Redis Cluster for the tests: masters with a replica each, on free loopback
ports, created with `redis-cli --cluster create`, with nodes to kill, stop and resume."""

from __future__ import annotations

import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from helpers import wait_until
from specserve.tools.local_cluster import PORTS_FROM, ephemeral_start, free_port

NODE_TIMEOUT_MS = 1000  # how long a master is unreachable before its replica takes over


def _cluster_ports(n: int) -> list[int]:
    """Free ports whose cluster bus port (+10000) is free too and below the ephemeral range
    (as free_port's own, where no outgoing connection takes it first), no node's port the bus
    port of another (a node whose bus port was a later node's port failed to start)."""
    ports: list[int] = []
    taken: set[int] = set()  # the chosen ports and their bus ports
    # (bus ports below the ephemeral range where there is room, else any that fits)
    top = ephemeral_start() if ephemeral_start() > PORTS_FROM + 10000 + n else 65536
    for _ in range(2000):
        port = free_port()
        if port + 10000 >= top or port in taken or port + 10000 in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
        taken.update((port, port + 10000))
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} ports with free cluster bus ports (+10000) found")


@dataclass
class RedisClusterNodes:
    workdir: Path
    masters: int = 3
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.live_ports()[0]}/0"

    def live_ports(self) -> list[int]:
        return [port for port, p in self.procs.items() if p.poll() is None]

    def start(self, timeout: float = 60) -> RedisClusterNodes:
        ports = _cluster_ports(2 * self.masters)
        for port in ports:
            (self.workdir / str(port)).mkdir(parents=True)
            self._launch(port)
        for port in ports:
            self._wait(lambda p=port: self.node(p).ping(), f"node {port} answers", timeout)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        self.wait_healthy(timeout)
        return self

    def _launch(self, port: int) -> None:
        d = self.workdir / str(port)
        self.procs[port] = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(d / "nodes.conf"),
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(d),
            ],
            stdout=open(d / "redis.log", "a"),
            stderr=subprocess.STDOUT,
        )

    def restart(self, port: int) -> None:
        """Starts a killed node again: it rejoins (from its nodes.conf, with no data) as a
        replica of the node that took over from it."""
        self._launch(port)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=2)

    def _wait(self, check, what: str, timeout: float) -> None:
        """wait_until, with a node that does not answer yet taken as not ready."""

        def answered() -> bool:
            try:
                return bool(check())
            except redis.RedisError:
                return False

        wait_until(answered, f"redis cluster: {what}", timeout)

    def roles(self) -> dict[int, str]:
        """Port -> master | slave, of the live nodes."""
        return {p: self.node(p).info("replication")["role"] for p in self.live_ports()}

    def wait_healthy(self, timeout: float = 60) -> None:
        """Every live node sees the cluster ok, and every live replica is linked to its
        master."""

        def healthy() -> bool:
            for port in self.live_ports():
                node = self.node(port)
                if node.cluster("info")["cluster_state"] != "ok":
                    return False
                replication = node.info("replication")
                if replication["role"] == "slave" and replication["master_link_status"] != "up":
                    return False
            return True

        self._wait(healthy, "cluster ok and replicas linked on every node", timeout)

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        client = RedisCluster(host="127.0.0.1", port=self.live_ports()[0])
        try:
            return client.get_node_from_key(key).port
        finally:
            client.close()

    def replica_of(self, master: int) -> int | None:
        """The live replica of a master, if it has one."""
        for port in self.live_ports():
            try:
                replication = self.node(port).info("replication")
            except redis.RedisError:
                continue
            if replication["role"] == "slave" and int(replication["master_port"]) == master:
                return port
        return None

    def node_id(self, port: int) -> str:
        return self.node(port).execute_command("CLUSTER", "MYID")

    def migrate_slot(
        self, slot: int, source: int, target: int, batch: int = 10, between=lambda: None
    ) -> int:
        """Moves a slot from master `source` to master `target` as `redis-cli --cluster
        reshard` does (IMPORTING, MIGRATING, MIGRATE of its keys a few at a time, calling
        `between` after each, then NODE on every master); returns how many keys moved."""
        src, dst = self.node(source), self.node(target)
        src_id, dst_id = self.node_id(source), self.node_id(target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            between()
        for port, role in self.roles().items():
            if role == "master":
                self.node(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait(timeout=30)

    def pause(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)
