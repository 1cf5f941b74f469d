"""`specserve rollout`: judge and steer a canary.

Verifiers run in two pools, stable and canary (the `pool` key of their config). The share of
new requests the canary gets is held in Redis and changed live, for every scheduler at once:

  specserve rollout status          pools, the versions they serve, the share
  specserve rollout canary 0.1      send 10% of new requests to the canary pool
  specserve rollout probe           greedy outputs of both pools on a fixed prompt set
  specserve rollout rollback        share 0; requests running on the canary finish there

A request stays on the model version that produced its first token (a requeued one waits for
a verifier of that version), so no stream mixes versions, whatever the share does meanwhile.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..common.pools import CANARY, POOLS, STABLE, by_pool, pool_shares, versions
from ..store import RequestStore
from ..v1 import common_pb2, scheduler_pb2

# Prompts whose greedy continuations are compared between the pools: code and prose, short.
PROBES = (
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(v):",
    "SELECT name, COUNT(*) FROM orders",
    "The capital of France is",
    "class Stack:\n    def __init__(self):",
    "To reverse a linked list in place,",
    "#include <stdio.h>\n\nint main(void) {",
    "The three laws of thermodynamics are",
)


def pools(store: RequestStore) -> dict[str, list[dict[str, str]]]:
    """Live verifiers by pool."""
    return by_pool(store.live_verifiers())


def status(store: RequestStore) -> dict:
    """The rollout as Redis holds it: the share, and per pool its verifiers and versions."""
    rollout = store.rollout()
    live = pools(store)
    shares = pool_shares(set(live), rollout["canary_share"])
    return {
        "canary_share": rollout["canary_share"],
        "previous_share": rollout["previous_share"],
        "pools": {
            name: {
                "share": shares.get(name, 0.0),
                "versions": versions(members),
                "configs": sorted({v.get("config", "") for v in members}),
                "verifiers": [v["id"] for v in members],
                "drafters": len(store.drafters(name)),
                "running": sum(int(v.get("running", 0)) for v in members),
            }
            for name, members in live.items()
        },
    }


def render_status(report: dict) -> str:
    lines = [
        f"canary share {report['canary_share']:.0%} (before the last change: "
        f"{report['previous_share']:.0%})",
        f"{'POOL':8} {'SHARE':>6} {'VERIFIERS':>9} {'DRAFTERS':>8} {'RUNNING':>7}  "
        "VERSIONS / CONFIGS",
    ]
    for name, p in report["pools"].items():
        lines.append(
            f"{name:8} {p['share']:>6.0%} {len(p['verifiers']):>9} {p['drafters']:>8} "
            f"{p['running']:>7}  "
            f"{', '.join(p['versions'])} / {', '.join(p['configs'])}"
        )
    if not report["pools"]:
        lines.append("(no live verifier)")
    return "\n".join(lines)


def canary_running(store: RequestStore) -> int:
    """Requests running on canary verifiers now (as Redis knows it)."""
    return sum(len(store.owned(v["id"])) for v in pools(store).get(CANARY, []))


def rollback(
    store: RequestStore,
    wait_seconds: float = 0.0,
    out: Callable[[str], None] = print,
) -> int:
    """Share 0: every new request goes to the stable pool; requests running on the canary
    finish there. With `wait_seconds`, waits until none runs there (then the canary pool can
    be removed); 0 if it emptied (or no wait was asked), 1 if it did not in time."""
    old = store.set_canary_share(0.0)
    out(f"canary share {old:.0%} -> 0%: new requests go to the stable pool")
    deadline = time.monotonic() + wait_seconds
    running = canary_running(store)
    while running and time.monotonic() < deadline:
        time.sleep(0.5)
        running = canary_running(store)
    if not running:
        out("the canary pool runs nothing: it can be removed")
        return 0
    if wait_seconds:
        out(f"{running} requests still run on the canary pool after {wait_seconds:g}s")
        return 1
    out(f"{running} requests finish on the canary pool (`specserve rollout status`)")
    return 0


@dataclass
class ProbeResult:
    prompt: str
    outputs: dict[str, list[int]]  # pool -> greedy token ids
    versions: dict[str, str]  # pool -> model version that produced them

    @property
    def agree(self) -> bool:
        return len({tuple(ids) for ids in self.outputs.values()}) == 1

    @property
    def prefix_agreement(self) -> float:
        """Tokens the pools agree on before they first differ, over the longest output."""
        a, b = self.outputs[STABLE], self.outputs[CANARY]
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        return same / max(1, len(a), len(b))


def agreement(results: list[ProbeResult]) -> dict:
    """Share of probes with identical greedy outputs, and the mean agreeing-prefix share."""
    n = max(1, len(results))
    return {
        "probes": len(results),
        "exact": sum(r.agree for r in results) / n,
        "prefix": sum(r.prefix_agreement for r in results) / n,
    }


def collect(store: RequestStore, rid: str, timeout: float) -> tuple[list[int], dict]:
    """A request's tokens (each index once) and final info, once it has ended."""
    last, deadline = "0-0", time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry_id, fields in store.tail(rid, last, 1000):
            if "final" in fields:
                return store.progress(rid), json.loads(fields["final"])
            last = entry_id
    raise TimeoutError(f"probe {rid} did not finish within {timeout:g}s")


def probe(
    store: RequestStore,
    scheduler,
    encode: Callable[[str], list[int]],
    max_tokens: int = 16,
    timeout: float = 120.0,
    prompts: tuple[str, ...] = PROBES,
) -> list[ProbeResult]:
    """Runs each prompt greedily in both pools (placed there whatever the share) and
    returns their outputs side by side."""
    live = pools(store)
    missing = [p for p in POOLS if p not in live]
    if missing:
        raise RuntimeError(f"no live verifier in the {' and '.join(missing)} pool")
    submitted = []
    for i, prompt in enumerate(prompts):
        for pool in POOLS:
            rid = f"probe-{uuid.uuid4().hex[:12]}-{i}-{pool}"
            scheduler.Submit(
                scheduler_pb2.SubmitRequest(
                    request_id=rid,
                    prompt_ids=encode(prompt),
                    max_tokens=max_tokens,
                    priority=common_pb2.PRIORITY_CLASS_BATCH,
                    pool=pool,
                ),
                timeout=30,
            )
            submitted.append((i, pool, rid))
    results = [ProbeResult(p, {}, {}) for p in prompts]
    for i, pool, rid in submitted:
        ids, final = collect(store, rid, timeout)
        if final.get("finish_reason") == "FINISH_REASON_ERROR":
            raise RuntimeError(f"probe in the {pool} pool failed: {final.get('error', '')}")
        results[i].outputs[pool] = ids
        results[i].versions[pool] = final.get("model_version", "")
    return results


def render_probe(results: list[ProbeResult]) -> str:
    summary = agreement(results)
    lines = [f"{'AGREE':5} {'PREFIX':>6}  PROMPT"]
    for r in results:
        prompt = r.prompt.replace("\n", "\\n")[:50]
        lines.append(f"{'yes' if r.agree else 'no':5} {r.prefix_agreement:>6.0%}  {prompt}")
    versions = results[0].versions if results else {}
    lines.append(
        f"\n{summary['probes']} probes, stable {versions.get(STABLE, '?')} vs canary "
        f"{versions.get(CANARY, '?')}: {summary['exact']:.0%} identical, "
        f"{summary['prefix']:.0%} of tokens agree before the first difference"
    )
    return "\n".join(lines)


def probe_json(results: list[ProbeResult]) -> str:
    return json.dumps(
        {"summary": agreement(results), "probes": [asdict(r) for r in results]}, indent=2
    )
