"""Serving under load: Poisson arrivals through the whole cluster with the default pair.

    python -m benchmarks.load [--rates 0.1,0.25,0.4,0.55] [--duration 75] [--tokens 48]

One cluster (scheduler, drafter, verifier, gateway; target in --dtype, draft model int8 chain 6
on a CPU). Per arrival rate, and for each speculation mode side by side (in turn, at the same
rate): `off` (requests pin SPECULATION_MODE_OFF), `fixed` (requests pin tree_size 6) and
`adaptive` (the service chooses the tree size per step from its cost model). The workload mixes
interactive (70%) and batch requests over three prompt kinds: code generation, prose, code
editing with the code given. Arrivals stop after --duration seconds; the run ends when the last
request has.

Per rate and mode: throughput (generated tokens / time from first arrival to last finish),
goodput (tokens of requests that met the SLO: interactive TTFT <= --slo-ttft and time per output
token <= --slo-tpot; batch ones count when they finish), TTFT, time per output token (TPOT:
(last token - first token) / (tokens - 1)) and inter-token latency (ITL: gaps between the
chunks a client receives) at p50 and p99, queue wait per class, mean accepted length. Times are
taken at the client. Writes <out>/load.json and <out>/load.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .prompts import PROMPTS

MODES = ("off", "fixed", "adaptive")
FIXED_TREE = 6
INTERACTIVE_SHARE = 0.7


def make_request(prompt: str, tokens: int, mode: str, batch: bool):
    spec = common_pb2.SpeculationOptions(
        mode=common_pb2.SPECULATION_MODE_OFF if mode == "off" else common_pb2.SPECULATION_MODE_AUTO
    )
    if mode == "fixed":
        spec.tree_size = FIXED_TREE
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens,
        speculation=spec,
        priority=common_pb2.PRIORITY_CLASS_BATCH
        if batch
        else common_pb2.PRIORITY_CLASS_INTERACTIVE,
    )
    req.messages.messages.add(role="user", content=prompt)
    return req


def one_request(stub, req, record: dict) -> None:
    started = time.perf_counter()
    record["start"] = started
    arrivals = []  # (seconds since start, tokens so far)
    tokens = 0
    try:
        for chunk in stub.Generate(req, timeout=1800):
            tokens += len(chunk.token_ids)
            if chunk.token_ids:
                arrivals.append((time.perf_counter() - started, tokens))
            if chunk.HasField("final"):
                final = chunk.final
                record["queue_s"] = final.timings.queue_ms / 1000
                record["accepted_length"] = final.speculation.mean_accepted_length
    except grpc.RpcError as e:
        record["error"] = e.code().name
    record["end"] = time.perf_counter()
    record["tokens"] = tokens
    record["arrivals"] = arrivals


def run_load(stub, rate: float, mode: str, args, rng: random.Random) -> list[dict]:
    """Poisson arrivals at `rate` per second for args.duration seconds; waits for all."""
    records, threads = [], []
    kinds = list(PROMPTS)
    t_end = time.perf_counter() + args.duration
    next_at = time.perf_counter() + rng.expovariate(rate)
    while next_at < t_end:
        time.sleep(max(0.0, next_at - time.perf_counter()))
        kind = rng.choice(kinds)
        batch = rng.random() >= INTERACTIVE_SHARE
        record = {"kind": kind, "class": "batch" if batch else "interactive"}
        req = make_request(PROMPTS[kind], args.tokens, mode, batch)
        thread = threading.Thread(target=one_request, args=(stub, req, record))
        thread.start()
        records.append(record)
        threads.append(thread)
        next_at += rng.expovariate(rate)
    for thread in threads:
        thread.join()
    return records


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def summarise(records: list[dict], args) -> dict:
    done = [r for r in records if "error" not in r and r["arrivals"]]
    if not done:
        return {"requests": len(records), "completed": 0}
    window = max(r["end"] for r in records) - min(r["start"] for r in records)
    ttft, tpot, itl, good = [], [], [], 0
    for r in done:
        first_s = r["arrivals"][0][0]
        last_s, n = r["arrivals"][-1]
        r_tpot = (last_s - first_s) / (n - 1) if n > 1 else 0.0
        ttft.append(first_s)
        tpot.append(r_tpot)
        itl.extend(b[0] - a[0] for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False))
        met = r["class"] == "batch" or (first_s <= args.slo_ttft and r_tpot <= args.slo_tpot)
        good += r["tokens"] if met else 0
    tokens = sum(r["tokens"] for r in done)
    queue = {
        cls: pct([r["queue_s"] for r in done if r["class"] == cls and "queue_s" in r], 50)
        for cls in ("interactive", "batch")
    }
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "throughput_tok_s": round(tokens / window, 3),
        "goodput_tok_s": round(good / window, 3),
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "itl_s": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
        "queue_wait_p50_s": queue,
        "mean_accepted_length": round(
            float(np.mean([r.get("accepted_length", 1.0) for r in done])), 2
        ),
    }


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(results, key=float)
    panels = [
        ("throughput_tok_s", None, "throughput (tokens/s)"),
        ("ttft_s", "p50", "TTFT p50 (s)"),
        ("tpot_s", "p50", "time per output token p50 (s)"),
        ("ttft_s", "p99", "TTFT p99 (s)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4))
    for ax, (key, sub, label) in zip(axes, panels, strict=True):
        for mode in MODES:
            ys = []
            for rate in rates:
                v = results[rate][mode].get(key)
                ys.append(v[sub] if sub and v else v)
            ax.plot([float(r) for r in rates], ys, marker="o", label=mode)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        "Default pair under Poisson load on this machine: speculation off / fixed / adaptive"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="0.1,0.25,0.4,0.55", help="arrivals per second, a list")
    p.add_argument("--duration", type=float, default=75.0, help="seconds of arrivals per run")
    p.add_argument("--tokens", type=int, default=48, help="max_tokens of every request")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--slo-ttft", type=float, default=15.0, help="interactive TTFT target (s)")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="interactive TPOT target (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    config = {
        "verifier": {
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "speculative_decoding": True,
            "speculation_policy": "adaptive",
            "verification_tree_size": FIXED_TREE,
        },
        "drafter": {
            "device": args.device,
            "dtype": "int8" if args.device == "cpu" else args.dtype,
            "max_depth": FIXED_TREE,
            "branching": 1,
            "width": 1,
        },
    }
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(config), Path(tmp)).start(timeout=900)
        try:
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                for mode in MODES:  # warm up: connect the drafter, start the cost model
                    one_request(stub, make_request("Say hi.", 8, mode, False), {})
                for rate in rates:
                    results[str(rate)] = {}
                    for mode in MODES:
                        rng = random.Random(args.seed)  # the same arrivals for every mode
                        records = run_load(stub, rate, mode, args, rng)
                        results[str(rate)][mode] = s = summarise(records, args)
                        print(
                            f"rate {rate:5.3f}/s {mode:>8}: {s.get('throughput_tok_s')} tok/s, "
                            f"TTFT p50 {s.get('ttft_s', {}).get('p50')} s, "
                            f"TPOT p50 {s.get('tpot_s', {}).get('p50')} s, "
                            f"accepted length {s.get('mean_accepted_length')}, "
                            f"{s.get('failed', 0)} failed",
                            flush=True,
                        )
        finally:
            cluster.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": f"python -m benchmarks.load --rates {args.rates} --duration {args.duration:g} "
        f"--tokens {args.tokens} --dtype {args.dtype} --device {args.device} "
        f"--batch-size {args.batch_size}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "results": results,
    }
    (out / "load.json").write_text(json.dumps(report, indent=2))
    chart(results, out / "load.png")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
