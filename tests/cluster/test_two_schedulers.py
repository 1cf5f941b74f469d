"""Two schedulers and two gateways on one Redis, under load: each gateway submits to its own
scheduler, both schedulers place from the same queues (one consumer group) and take over each
other's idle entries every half second, so they race for the same requests all the time.
No request runs twice, none is lost, every output is the model's own."""

from __future__ import annotations

import re
import threading
from collections import Counter

import pytest

from conftest import cluster_config
from helpers import Client
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.cluster  # every test here runs a cluster

REQUESTS = 16
MAX_TOKENS = 24


def test_two_schedulers_and_two_gateways_place_each_request_once(
    tmp_path, tiny_model_dir, tiny_model
):
    config = cluster_config(
        tiny_model_dir,
        scheduler={"scheduler_id": "scheduler-1", "reclaim_idle_seconds": 0.5},
        verifier={"batch_size": 2, "interactive_reserved_slots": 0},
    )
    cluster = LocalCluster(config, tmp_path).start(timeout=180)
    try:
        second = {"SPECSERVE_SCHEDULER_SCHEDULER_ID": "scheduler-2"}
        cluster.start_service("scheduler", second, instance="scheduler-2")
        drafter = cluster.procs["drafter"].address
        verifier_env = {"SPECSERVE_VERIFIER_DRAFTER_ADDRESSES": f'["{drafter}"]'}
        cluster.start_service("verifier", verifier_env, instance="verifier-2")
        gateway_env = {"SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler-2"].address}
        cluster.start_service("gateway", gateway_env, instance="gateway-2")
        for key in ("verifier-2", "gateway-2"):
            cluster.wait_ready(key, 120)

        prompts = [[7 + i, 3, 11 + 2 * i, 5] for i in range(REQUESTS)]
        clients = [Client(f"two-{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)]
        gateways = [cluster.procs[g].address for g in ("gateway", "gateway-2")]
        threads = [
            threading.Thread(target=c.run, args=(gateways[i % 2], 240))
            for i, c in enumerate(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        assert [c.error for c in clients] == [""] * REQUESTS

        for client, prompt in zip(clients, prompts, strict=True):
            assert client.ids() == hf_greedy(tiny_model, prompt, MAX_TOKENS), client.rid
            assert sorted(client.indices()) == list(range(MAX_TOKENS)), client.rid
        store = RequestStore.from_url(cluster.redis_url)
        records = [store.get(c.rid) for c in clients]
        assert [r.status for r in records] == ["finished"] * REQUESTS
        assert [r.requeues for r in records] == [0] * REQUESTS  # claimed once, ran once

        admitted = Counter()  # request id -> Admits that claimed it, over both verifiers
        for key in ("verifier", "verifier-2"):
            for line in cluster.procs[key].log_text().splitlines():
                if '"msg": "admitted"' in line:
                    admitted[re.search(r'"request_id": "([^"]+)"', line).group(1)] += 1
        assert admitted == {c.rid: 1 for c in clients}
        placed = {
            key: cluster.procs[key].log_text().count('"msg": "placed"')
            for key in ("scheduler", "scheduler-2")
        }
        assert all(placed.values()), f"one scheduler placed nothing: {placed}"
    finally:
        cluster.stop()
