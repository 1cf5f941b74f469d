"""What a decode step pays for writing its tokens to Redis: the step write on the loop's path
(each step waits for its round trip) against the async writer (the write travels while the
next step computes).

    python -m benchmarks.step_writes [--tiny] [--persistence none,everysec,always]
        [--requests 8] [--tokens 128] [--reps 5]

The verifier's real Engine and block pool in this process, against a private redis-server on
loopback, plain decoding, float32, with SmolLM2-135M as the target (`specserve models fetch
smollm2-135m-instruct@0.1.2` first) or, with --tiny, a tiny random Qwen2 (2 layers, hidden 64:
a step of a few milliseconds, where a round trip shows). The same requests run with each
writer, the two interleaved rep by rep. Reported per writer: the mean step time (wall time of
all steps / steps), the steps; and the mean time of one step write (commit_step, one
pipelined round trip for the batch, timed around the call) while the step waited for it. The
step's compute is the synchronous step less its write; the overhead of each writer is its
step time over that.
With --persistence, one Redis per policy (none, or an append-only file fsynced `everysec` or
`always`, as deployed), runs interleaved: a write's median against none's is what
persistence costs. Writes <out>/step_writes[_tiny][_persistence].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from benchmarks import write_results
from benchmarks.kv_concurrency import VID, NoDrafts, sequence, smollm2, tiny_qwen
from specserve.common.settings import ServiceSettings
from specserve.engine.flat_model import FlatModel
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port
from specserve.verifier.admission import Admission
from specserve.verifier.engine import Engine, engine_settings
from specserve.verifier.runner import ModelRunner
from specserve.verifier.writes import Owner


class TimedStore(RequestStore):
    """The real store; each commit_step's duration recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes: list[float] = []

    def commit_step(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().commit_step(*args, **kwargs)
        finally:
            self.writes.append(time.perf_counter() - start)


def run(flat: FlatModel, store: TimedStore, args, async_writes: bool, rep: int) -> dict:
    pool = flat.use_pool(args.requests * (args.prompt + args.tokens + 32), 16, fixed=True)
    admission = Admission(pool, args.requests, 0, prefix_cache=False)
    engine = Engine(
        ModelRunner(flat),
        NoDrafts(),
        store,
        admission,
        **engine_settings(
            max_seq_len=4096,
            max_prefill_tokens=4096,
            async_step_writes=async_writes,
            max_unread_tokens=0,  # (no client reads here: nothing pauses)
        ),
        owner=Owner(verifier_id=VID),
        eos_ids=set(),
        decode=lambda ids: "",
    )
    for i in range(args.requests):
        rid = f"{'async' if async_writes else 'sync'}-{rep}-{i}"
        prompt = [(7 * i + k) % 1000 + 1 for k in range(args.prompt)]
        store.create(rid, {"prompt_ids": prompt, "max_tokens": args.tokens}, "interactive", 10**6)
        store.claim(rid, VID, int(time.time() * 1000))
        seq = sequence(rid, prompt, args.tokens)
        engine.admit(seq, admission.admit(rid, "interactive", prompt))
    engine._take_new(block=False)
    engine.step()  # the prefill, not timed
    store.writes.clear()
    steps, start = 0, time.perf_counter()
    while engine.running:
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    return {
        "steps": steps,
        "step_ms": 1000 * wall / steps,
        "write_ms": 1000 * statistics.mean(store.writes),
    }


POLICIES = {  # Redis persistence: the server's arguments
    "none": ["--appendonly", "no"],
    "everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "always": ["--appendonly", "yes", "--appendfsync", "always"],  # as deployed
}


def summarize(rows: list[dict]) -> dict:
    return {
        "step_ms_median": round(statistics.median(r["step_ms"] for r in rows), 3),
        "step_ms_spread": [
            round(min(r["step_ms"] for r in rows), 3),
            round(max(r["step_ms"] for r in rows), 3),
        ],
        "write_ms_median": round(statistics.median(r["write_ms"] for r in rows), 3),
        "steps": rows[0]["steps"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="the batch")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default=ServiceSettings().model_cache_dir, help="model cache")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen2, not SmolLM2-135M")
    p.add_argument(
        "--persistence",
        default="none",
        help="Redis persistence, a comma-separated list of none, everysec and always (an "
        "append-only file with that fsync policy; deployed: always, each write waits for its "
        "fsync): a Redis each, runs interleaved (default none)",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    policies = args.persistence.split(",")
    if unknown := set(policies) - set(POLICIES):
        p.error(f"--persistence: unknown {sorted(unknown)}; choose from {list(POLICIES)}")
    torch.set_num_threads(args.threads)
    flat = FlatModel(tiny_qwen() if args.tiny else smollm2(args))
    runs = [(policy, writer) for policy in policies for writer in ("sync", "async")]
    reps: dict[str, list[dict]] = {f"{policy}/{writer}": [] for policy, writer in runs}
    with tempfile.TemporaryDirectory() as tmp:
        servers, stores = [], {}
        try:
            for policy in policies:
                port = free_port()
                folder = f"{tmp}/{policy}"
                os.mkdir(folder)
                servers.append(
                    subprocess.Popen(
                        ["redis-server", "--port", str(port), "--save", "", "--dir", folder]
                        + POLICIES[policy],
                        stdout=subprocess.DEVNULL,
                    )
                )
                base = RequestStore.from_url(f"redis://127.0.0.1:{port}/0")
                stores[policy] = TimedStore(base.r, base._probe)
                stores[policy].wait_reachable()
                stores[policy].ensure_queues()
            for rep in range(args.reps):  # interleaved: the machine's drift hits all alike
                for policy, writer in runs:
                    row = run(flat, stores[policy], args, writer == "async", rep)
                    reps[f"{policy}/{writer}"].append(row)
                    print(policy, writer, json.dumps(row), flush=True)
        finally:
            for server in servers:
                server.terminate()
    summary = {name: summarize(rows) for name, rows in reps.items()}
    sync = summary[f"{policies[0]}/sync"]
    compute = sync["step_ms_median"] - sync["write_ms_median"]
    for name in summary:
        summary[name]["overhead_vs_compute"] = round(
            summary[name]["step_ms_median"] / compute - 1, 4
        )
    target = "a tiny random Qwen2 (2 layers, hidden 64)" if args.tiny else "SmolLM2-135M"
    report = {
        "command": f"python -m benchmarks.step_writes --requests {args.requests} --prompt "
        f"{args.prompt} --tokens {args.tokens} --reps {args.reps} --threads {args.threads} "
        f"--dtype {args.dtype} --persistence {args.persistence}" + " --tiny" * args.tiny,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": f"{target} {args.dtype} target, cpu ({args.threads} threads), plain "
        f"decoding, in-process engine, batch {args.requests}, a private redis-server on "
        f"loopback per persistence policy ({', '.join(policies)}), the data folder on "
        f"{_filesystem(tempfile.gettempdir())}",
        "compute_ms_per_step": round(compute, 3),
        "writers": summary,  # "<persistence>/<writer>"
        "reps": reps,
    }
    name = f"step_writes{'_tiny' if args.tiny else ''}"
    name += "" if policies == ["none"] else "_persistence"
    write_results(report, args.out, name, shown=summary)


def _filesystem(path: str) -> str:
    """The file system a folder is on (an fsync's cost is its disk's)."""
    out = subprocess.run(["df", "--output=source,fstype", path], capture_output=True, text=True)
    lines = out.stdout.split("\n")
    return " ".join(lines[1].split()) if out.returncode == 0 and len(lines) > 1 else "unknown"


if __name__ == "__main__":
    main()
