"""free_port: ports for services to bind later come from below the ephemeral range, where
outgoing connections take theirs, and never twice."""

from __future__ import annotations

import socket
from pathlib import Path

from specserve.tools.local_cluster import PORTS_FROM, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(PORTS_FROM <= p < max(low, PORTS_FROM + 1000) for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # (still free)
