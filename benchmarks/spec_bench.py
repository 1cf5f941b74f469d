"""Spec-Bench (and the other workloads) through the cluster: the default config with
speculation on and off, at several concurrencies, decode rate and accepted length per category.

    python -m benchmarks.spec_bench [--per-category 1] [--tokens 96] [--concurrency 1,4,16]
                                    [--dtype auto] [--workload spec_bench] [--rounds 1]
                                    [--out DIR] [--set SECTION.KEY=VALUE ...] [--keep-logs DIR]

At concurrency c each category is measured under a load of its own kind: --per-category
groups of c streams of that category's questions sent together (first turn and system
message, greedy; in the group's order, STAGGER apart, so that both modes see the same
arrivals), with speculation on, then the same group with it off. A category's figure
is the mean over its streams, and so what that category gets while c of its kind share the
verifier; a group mixing categories would instead time each stream by whichever others it
happened to run beside (one stream a category in mixed groups of 16 moved by 0.5-2.7x between
the modes). The questions (benchmarks/workloads.py: Spec-Bench's 13 categories by default;
code_edit, agentic) go in file order, each answered at one concurrency only, since the
drafter learns every completed answer of the tenant and would draft a repeated one back;
a category with fewer questions left than c streams repeats its remaining ones within the
group (streams of one group start together, so none learns from a twin's answer before its
own ends), and the results count the distinct questions. One cluster of config/specserve.yaml's
verifier and drafter sections (less their ports; --dtype for target and drafter; the
verifier's batch_size the largest concurrency; its prefix cache off, since each prompt goes
once per mode). Speculation off is the same cluster with each request's `speculation.mode =
OFF`; on goes first in each group, so that no stream with speculation on comes after its own
prompt's plain answer (which the drafter learns), and the two modes see the same minutes of
a machine whose speed drifts. Each stream is timed as benchmarks.speculative times one
(token arrivals at the client): decode tokens/s = tokens after the first / time from the
first to the last; per concurrency, the tokens of all streams over the time their groups
took.

With --rounds N all of it runs N times, each round on a fresh cluster (which has learned
nothing of the questions, so they are asked again): every figure is then the median over the
rounds, with each round's beside it (`<name>_by_round`), and a speedup is the median of each
round's own on over off. Rows at L 1.00, where both modes do the same work, read 0.80-1.12x in
one round on a 2-core EPYC while a group's streams were sent at once, and 0.90-1.04x on a
2-core Xeon since they are staggered: one round of one question a category does not settle a
0.97 target.
Writes <out>/spec_bench.json and <out>/spec_bench.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import grpc
import yaml

from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from . import workloads
from .speculative import timing

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config/specserve.yaml"


# On first in each group: the drafter learns every completed output of the tenant (plain ones
# too), so a stream with speculation on after the same prompt's plain one would draft its own
# answer back. After the group's on streams, the plain ones learn nothing they could use.
MODES = {"on": common_pb2.SPECULATION_MODE_AUTO, "off": common_pb2.SPECULATION_MODE_OFF}
# A group's streams are sent in its order, this many seconds apart, so that both modes see the
# same arrivals. Sent at once, they reached the verifier in an order of chance: the first
# prompt in went through a step of its own and its stream decoded through the others' prompt
# chunks (2-3 s a step at four streams on an AMX Xeon), the rest waited for it. Which stream
# that was moved a category's mean decode rate more than speculation did: a 13-token answer
# read 4.0 tokens/s where it came first and 14.8 where it did not, and a group at the same
# accepted length and the same wall time in both modes read 0.86x.
STAGGER = 0.01


def stream(
    stub,
    prompt: str | dict,
    tokens: int,
    mode: int = common_pb2.SPECULATION_MODE_AUTO,
    delay: float = 0.0,
) -> dict:
    """One greedy stream of a user message, or of a workload row (benchmarks.workloads),
    sent after `delay` seconds."""
    time.sleep(delay)
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


def cluster_config(levels: list[int], dtype: str, overrides: Iterable[str] = ()) -> dict:
    """config/specserve.yaml's verifier and drafter sections, less their ports, with `dtype`
    and a batch for the largest concurrency; then `overrides` ("verifier.KEY=VALUE", the
    value read as YAML)."""
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())
    verifier, drafter = (
        {k: v for k, v in default[section].items() if k not in ("port", "drafter_addresses")}
        for section in ("verifier", "drafter")
    )
    config = {
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
    for override in overrides:
        key, _, value = override.partition("=")
        section, _, name = key.partition(".")
        if section not in config or not name or not value:
            raise SystemExit(f"--set {override}: expected verifier.KEY=VALUE or drafter.KEY=VALUE")
        config[section][name] = yaml.safe_load(value)
    return config


def groups(rows: list[dict], levels: list[int], per_category: int) -> dict[int, list[list[dict]]]:
    """Per concurrency c, `per_category` groups of c streams for each category, from its
    questions in file order; a question is used at one concurrency only, and a group short
    of questions repeats its own (see the module's docstring)."""
    left: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        left[row["category"]].append(row)
    out: dict[int, list[list[dict]]] = {}
    for c in levels:
        out[c] = []
        for questions in left.values():
            for _ in range(per_category):
                own = questions[:c]
                del questions[:c]  # (asked at this concurrency only)
                if own:
                    out[c].append([own[i % len(own)] for i in range(c)])
    return out


def cluster_arguments(p: argparse.ArgumentParser) -> None:
    """--set and --keep-logs, for the benchmarks that start a cluster of the default config."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config key of the cluster (e.g. drafter.proposer=suffix); repeatable",
    )
    p.add_argument(
        "--keep-logs",
        type=Path,
        metavar="DIR",
        help="run the cluster in DIR and keep its logs there (with --set "
        "verifier.log_level=DEBUG: every step's tree sizes and times, which "
        "`python -m benchmarks.step_log DIR/verifier.log` sums per request, or with "
        "--groups per group of streams)",
    )


def cluster_dir(keep: Path | None):
    """Where the cluster's config and logs go: `keep` (--keep-logs), kept, or a temporary
    directory, removed with the cluster."""
    if keep is None:
        return tempfile.TemporaryDirectory()
    keep.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(keep))


def run(rows: list[dict], args) -> dict:
    """Per concurrency c, each group's c streams sent at once with speculation on, then the
    same with it off, group after group. Per mode and c: each stream's figures by category,
    and the tokens of all its streams over the time its groups took."""
    levels = [int(c) for c in args.concurrency.split(",")]
    out: dict[str, dict] = {"off": {}, "on": {}}
    with cluster_dir(args.keep_logs) as tmp:
        cluster = LocalCluster(
            without_security(cluster_config(levels, args.dtype, args.set)), Path(tmp)
        )
        try:
            cluster.start(timeout=900)
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                stream(stub, "Say hi.", 8)  # (warm-up; and the drafter connected)
                for c, level in groups(rows, levels, args.per_category).items():
                    asked = [row for group in level for row in group]
                    results = {mode: [] for mode in MODES}
                    walls = dict.fromkeys(MODES, 0.0)
                    for group in level:
                        for mode, value in MODES.items():
                            started = time.perf_counter()
                            with cf.ThreadPoolExecutor(len(group)) as pool:
                                results[mode] += pool.map(
                                    lambda i, r, v=value: stream(
                                        stub, r, args.tokens, v, delay=i * STAGGER
                                    ),
                                    range(len(group)),
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
        by_category[row["category"]].append(r | {"question_id": row["question_id"]})
    return {
        "tokens_per_s_total": round(sum(r["tokens"] for r in results) / wall, 2),
        "categories": {
            category: {
                "streams": len(rs),
                "questions": len({r["question_id"] for r in rs}),
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


def add_speedups(modes: dict) -> None:
    """Speculation on over off, within one run: in all per concurrency (`speedup_total`) and
    per category (`speedup`), on the `on` mode's rows."""
    for c, on in modes["on"].items():
        off = modes["off"][c]
        on["speedup_total"] = round(on["tokens_per_s_total"] / off["tokens_per_s_total"], 3)
        for category, row in on["categories"].items():
            base = off["categories"][category]["decode_tokens_per_s"]
            row["speedup"] = round(row["decode_tokens_per_s"] / base, 3) if base else None


def report(modes: dict, which: str = "") -> None:
    for c, on in modes["on"].items():
        print(
            f"concurrency {c}{which}: {on['speedup_total']}x in all; by category "
            + " ".join(f"{k}={v['speedup']}" for k, v in on["categories"].items()),
            flush=True,
        )


# Figures merge_rounds takes the median of; the speedups among them are each round's own ratio.
MEDIAN_FIELDS = frozenset(
    {
        "tokens_per_s_total",
        "speedup_total",
        "decode_tokens_per_s",
        "mean_accepted_length",
        "ttft_ms",
        "speedup",
    }
)


def merge_rounds(rounds: list[dict]) -> dict:
    """Several rounds' modes (each with its speedups) as one: every figure the median over
    the rounds, each round's beside it (`<name>_by_round`); other fields as they were where
    every round agrees, else round by round."""
    first, out = rounds[0], {}
    for name, value in first.items():
        values = [r[name] for r in rounds]
        if isinstance(value, dict):
            out[name] = merge_rounds(values)
        elif name in MEDIAN_FIELDS and None not in values:
            out[name] = round(statistics.median(values), 3)
            out[f"{name}_by_round"] = values
        elif all(v == value for v in values):
            out[name] = value
        else:
            out[f"{name}_by_round"] = values
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--per-category", type=int, default=1, help="groups per category at each concurrency"
    )
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--dtype", default="auto", help="target and drafter")
    p.add_argument(
        "--workload",
        default="spec_bench",
        help=f"comma-separated: {', '.join(workloads.NAMES)}, or .jsonl paths (see workloads.py)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times all of it runs, each round on a fresh cluster; figures are then medians "
        "over rounds and speedups the median of each round's own",
    )
    cluster_arguments(p)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    streams = sum(int(c) for c in args.concurrency.split(","))
    rows = workloads.rows(args.workload, args.per_category * streams)
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        modes = run(rows, args)
        add_speedups(modes)
        report(modes)
        rounds.append(modes)
    modes = rounds[0] if args.rounds == 1 else merge_rounds(rounds)
    if args.rounds > 1:
        report(modes, f", median of {args.rounds} rounds")
    record = {
        "command": f"python -m benchmarks.spec_bench --per-category {args.per_category} "
        f"--tokens {args.tokens} --concurrency {args.concurrency} --dtype {args.dtype} "
        f"--workload {args.workload} --rounds {args.rounds}"
        + "".join(f" --set {o}" for o in args.set),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "questions": len(rows),
        "rounds": args.rounds,
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
