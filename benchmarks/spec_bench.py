"""Spec-Bench (and the other workloads) through the cluster: the default config with
speculation on and off, at several concurrencies, decode rate and accepted length per category.

    python -m benchmarks.spec_bench [--per-category 1] [--tokens 96] [--concurrency 1,4,16]
                                    [--dtype auto] [--workload spec_bench] [--out DIR]

For each concurrency its own --per-category questions of each category of the workloads
(benchmarks/workloads.py: Spec-Bench's 13 by default; code_edit, agentic), first turn and
system message, greedy, through one cluster of config/specserve.yaml's verifier and drafter
sections (less their ports; --dtype for target and drafter; the verifier's batch_size the
largest concurrency; its prefix cache off, since each prompt is sent once per mode).
Speculation off is the same cluster with each request's `speculation.mode = OFF`, and on and
off alternate group by group, on first (see `run`): a machine whose speed drifts by 10% between
minutes (this one) moves both alike, and no stream with speculation on comes after its own
prompt's plain answer (which the drafter learns, as it learns every completed output of the
tenant). Each stream is timed as benchmarks.speculative times one (token arrivals at the
client): decode tokens/s = tokens after the first / time from the first to the last; per
category the mean over its streams, and per concurrency the tokens of all streams over the time
their groups took.
Writes <out>/spec_bench.json and <out>/spec_bench.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import grpc
import yaml

from specserve.local_cluster import LocalCluster, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from . import workloads
from .speculative import timing

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config/specserve.yaml"


# On first in each group: the drafter learns every completed output of the tenant (plain ones
# too), so a stream with speculation on after the same prompt's plain one would draft its own
# answer back. After the group's on streams, the plain ones learn nothing they could use.
MODES = {"on": common_pb2.SPECULATION_MODE_AUTO, "off": common_pb2.SPECULATION_MODE_OFF}


def stream(
    stub, prompt: str | dict, tokens: int, mode: int = common_pb2.SPECULATION_MODE_AUTO
) -> dict:
    """One greedy stream of a user message, or of a workload row (benchmarks.workloads)."""
    row = {"turns": [prompt]} if isinstance(prompt, str) else prompt
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens, speculation=common_pb2.SpeculationOptions(mode=mode)
    )
    for message in workloads.messages(row):
        req.messages.messages.add(**message)
    arrivals, final, count = [], None, 0
    started = time.perf_counter()
    for chunk in stub.Generate(req, timeout=3600):
        if chunk.token_ids:
            count += len(chunk.token_ids)
            arrivals.append((time.perf_counter(), count))
        if chunk.HasField("final"):
            final = chunk.final
    return timing(started, arrivals) | {
        "mean_accepted_length": round(final.speculation.mean_accepted_length, 2),
        "target_version": final.model_version,
    }


def cluster_config(levels: list[int], dtype: str) -> dict:
    """config/specserve.yaml's verifier and drafter sections, less their ports, with `dtype`
    and a batch for the largest concurrency."""
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())
    verifier, drafter = (
        {k: v for k, v in default[section].items() if k not in ("port", "drafter_addresses")}
        for section in ("verifier", "drafter")
    )
    return {
        "verifier": verifier
        | {
            "dtype": dtype,
            "batch_size": max(levels),
            "interactive_reserved_slots": 0,
            "draft_timeout_seconds": 60,
            # Off: the same prompt goes once per mode, and a cached prefix would spare the
            # second its prefill (and the steps it shares with other streams).
            "prefix_cache": False,
        },
        "drafter": drafter | {"dtype": dtype},
    }


def by_level(rows: list[dict], levels: int) -> list[list[dict]]:
    """The questions split into `levels` sets, each with its share of every category: a
    question answered at one concurrency is not asked again at the next (the drafter learns
    every answer, and would draft a repeated one back)."""
    seen: dict[str, int] = defaultdict(int)
    sets: list[list[dict]] = [[] for _ in range(levels)]
    for row in rows:
        sets[seen[row["category"]] % levels].append(row)
        seen[row["category"]] += 1
    return sets


def run(rows: list[dict], args) -> dict:
    """Per concurrency c, the questions in groups of c: each group's c streams sent at once
    with speculation on, then the same with it off, group after group (so both modes see the
    same moments of a noisy machine). Per mode and c: each stream's figures by category, and
    the tokens of all its streams over the time its groups took."""
    levels = [int(c) for c in args.concurrency.split(",")]
    out: dict[str, dict] = {"off": {}, "on": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(cluster_config(levels, args.dtype)), Path(tmp))
        try:
            cluster.start(timeout=900)
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                stream(stub, "Say hi.", 8)  # (warm-up; and the drafter connected)
                for c, asked in zip(levels, by_level(rows, len(levels)), strict=True):
                    results = {mode: [] for mode in MODES}
                    walls = dict.fromkeys(MODES, 0.0)
                    for start in range(0, len(asked), c):
                        group = asked[start : start + c]
                        for mode, value in MODES.items():
                            started = time.perf_counter()
                            with cf.ThreadPoolExecutor(len(group)) as pool:
                                results[mode] += pool.map(
                                    lambda r, v=value: stream(stub, r, args.tokens, v),
                                    group,
                                )
                            walls[mode] += time.perf_counter() - started
                    for mode in MODES:
                        out[mode][str(c)] = summary(asked, results[mode], walls[mode])
                        print(
                            f"speculation {mode}, concurrency {c}: "
                            f"{out[mode][str(c)]['tokens_per_s_total']} tokens/s in all",
                            flush=True,
                        )
        finally:
            cluster.stop()
    return out


def summary(rows: list[dict], results: list[dict], wall: float) -> dict:
    by_category = defaultdict(list)
    for row, r in zip(rows, results, strict=True):
        by_category[row["category"]].append(r)
    return {
        "tokens_per_s_total": round(sum(r["tokens"] for r in results) / wall, 2),
        "categories": {
            category: {
                "decode_tokens_per_s": round(
                    statistics.mean(r["decode_tokens_per_s"] or 0 for r in rs), 2
                ),
                "mean_accepted_length": round(
                    statistics.mean(r["mean_accepted_length"] for r in rs), 2
                ),
                "ttft_ms": round(statistics.mean(r["ttft_ms"] for r in rs)),
            }
            for category, rs in by_category.items()
        },
        "target_version": results[0]["target_version"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--dtype", default="auto", help="target and drafter")
    p.add_argument(
        "--workload",
        default="spec_bench",
        help=f"comma-separated: {', '.join(workloads.NAMES)}, or .jsonl paths (see workloads.py)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    levels = len(args.concurrency.split(","))
    rows = workloads.rows(args.workload, args.per_category * levels)
    modes = run(rows, args)
    for c, on in modes["on"].items():
        off = modes["off"][c]
        on["speedup_total"] = round(on["tokens_per_s_total"] / off["tokens_per_s_total"], 3)
        for category, row in on["categories"].items():
            base = off["categories"][category]["decode_tokens_per_s"]
            row["speedup"] = round(row["decode_tokens_per_s"] / base, 3) if base else None
        print(
            f"concurrency {c}: {on['speedup_total']}x in all; by category "
            + " ".join(f"{k}={v['speedup']}" for k, v in on["categories"].items()),
            flush=True,
        )
    record = {
        "command": f"python -m benchmarks.spec_bench --per-category {args.per_category} "
        f"--tokens {args.tokens} --concurrency {args.concurrency} --dtype {args.dtype} "
        f"--workload {args.workload}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "questions": [r["question_id"] for r in rows],
        "modes": modes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(modes, args.out / "spec_bench.png")


def plot(modes: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(modes["on"])
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4.5), squeeze=False)
    for ax, c in zip(axes[0], levels, strict=True):
        categories = sorted(modes["on"][c]["categories"])
        for i, mode in enumerate(("off", "on")):
            values = [modes[mode][c]["categories"][k]["decode_tokens_per_s"] for k in categories]
            ax.bar([x + i * 0.4 for x in range(len(categories))], values, 0.4, label=mode)
        ax.set_xticks([x + 0.2 for x in range(len(categories))], categories, rotation=45)
        ax.set_title(f"concurrency {c}: {modes['on'][c]['speedup_total']}x in all")
        ax.set_ylabel("decode tokens/s per stream")
        ax.legend(title="speculation", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
