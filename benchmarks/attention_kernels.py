"""Attention kernels for one call per layer over all sequences, against per-sequence SDPA.

    python -m benchmarks.attention_kernels [--quick] [--rounds 11] [--threads 2,1]
        [--device cpu] [--dtypes bfloat16,float32] [--no-recompiles]

Candidates (benchmarks/attention_batch.py), all computing the same attention:
- reference: one SDPA per sequence over its own KV buffer, dense [new, past + new] bool mask
  built on the host (the per-sequence FlatModel before the block pool).
- padded: one SDPA over [B, heads, Nmax, d], K/V gathered from the block pool into
  [B, kv_heads, Lmax, d], a [B, 1, Nmax, Lmax] mask built from (past, new) per sequence
  (what services/engine/attention.py does).
- padded_nogather: the same over contiguous per-sequence KV (prices the gather).
- padded_expanded: padded with K/V repeated to the query heads instead of SDPA's grouped-query
  path (enable_gqa), which CUDA's memory-efficient kernel refuses: with a mask and
  enable_gqa, SDPA on CUDA can only take its math kernel. Each case also records which SDPA
  backends (flash, efficient, cudnn, math) take the padded call, grouped or expanded.
- padded_grouped (steps with a prompt chunk): one padded call for decode and tree sequences,
  one for the chunk, so that the chunk does not pad every tree to its length.
- flex: FlexAttention compiled with torch.compile (static shapes) over the packed batch, its
  block mask built every step by create_block_mask (compiled; the eager build is timed too).
SDPA over jagged nested tensors is only probed: it takes no mask.

Each (model, dtype, step) case times the candidates interleaved, round after round (the machine
is shared), and reports per call (one layer) the median and minimum time, the median of
per-round ratios to the reference, the per-step setup shared by all layers (masks, slot
tables, block mask), the step's total over all layers, and the max abs difference from the
reference. One run per torch thread count: with several threads the clock is wall time, with
one thread the CPU time of the calling thread (what other load on the machine disturbs least);
on a device (`--device cuda`) always wall time, the device synchronised before and after.
A second part counts FlexAttention compiles when T and sum L change every step, for dynamic
False, None (automatic) and True. Inductor compiles into a fresh cache directory, so first
calls are cold. Writes <out>/attention_kernels.json (--quick: attention_kernels_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import flex_attention

from .attention_batch import (
    Heads,
    Seq,
    grouped_plans,
    host_masks,
    make_case,
    nested_probe,
    packed_flex,
    packed_plan,
    padded,
    padded_grouped,
    padded_plan,
    per_sequence,
)

MODELS = {
    "qwen2.5-coder-1.5b": Heads(heads=12, kv_heads=2, head_dim=128, layers=28),
    "smollm2-135m": Heads(heads=9, kv_heads=3, head_dim=64, layers=30),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
TREE = 17  # pending token + 16 draft nodes


def steps(quick: bool) -> dict[str, list[Seq]]:
    found = {}
    for context in (512, 2048):
        for b in (1, 4, 8):
            found[f"decode_b{b}_ctx{context}"] = [Seq(context, 1)] * b
    for b in (1, 4):
        found[f"tree_b{b}_ctx512"] = [Seq(512, TREE, tree=True)] * b
    for context in (0, 1024):
        found[f"mixed_prefill256_ctx{context}"] = [Seq(context, 256)] + [
            Seq(512, TREE, tree=True)
        ] * 3
    if quick:
        return {
            k: found[k] for k in ("decode_b4_ctx512", "tree_b4_ctx512", "mixed_prefill256_ctx1024")
        }
    return found


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def sync() -> None:
    """Waits for the device's queued kernels (CUDA runs them after the call returns)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, inner: int) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds per call of fn, over `inner` calls."""
    sync()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - wall) / inner, (time.thread_time() - cpu) / inner


BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def backend_probe(case, plan) -> dict[str, str]:
    """Which SDPA backends take the padded call (bool mask), with grouped-query heads
    (enable_gqa) and with K/V expanded to the query heads: "ran", or why not."""
    found = {}
    for name, backend in BACKENDS.items():
        for expand in (False, True):
            key = f"{name}{'_expanded' if expand else '_gqa'}"
            with warnings.catch_warnings(record=True) as said:  # (SDPA warns why not)
                warnings.simplefilter("always")
                try:
                    padded(case, plan, expand=expand, backend=backend)
                    sync()
                except Exception as error:  # the refusal is the result
                    why = [str(w.message).strip().splitlines()[0] for w in said]
                    found[key] = "; ".join(why or [f"{type(error).__name__}: {error}"])[:300]
                else:
                    found[key] = "ran"
    return found


def run_case(
    seqs: list[Seq], shape: Heads, dtype, flex, rounds: int, inner: int, clock: int, device: str
):
    """Times every candidate on one step; clock 0: wall time, 1: CPU time of this thread."""
    case = make_case(seqs, shape, dtype, device=device)
    setups = {
        "reference": lambda: host_masks(case),
        "padded": lambda: padded_plan(case),
        "padded_grouped": lambda: grouped_plans(case),
        "flex": lambda: packed_plan(case, compile_mask=True),
        "flex_eager_mask": lambda: packed_plan(case),
    }
    started = time.perf_counter()
    plans = {name: setup() for name, setup in setups.items()}
    mask_first_s = round(time.perf_counter() - started, 3)  # compiles the mask function
    kernels = {
        "reference": lambda: per_sequence(case, plans["reference"]),
        "padded": lambda: padded(case, plans["padded"]),
        "padded_nogather": lambda: padded(case, plans["padded"], gather=False),
        "padded_expanded": lambda: padded(case, plans["padded"], expand=True),
        "padded_grouped": lambda: padded_grouped(case, plans["padded_grouped"]),
        "flex": lambda: packed_flex(case, plans["flex"], flex),
    }
    if len(plans["padded_grouped"]) < 2:  # one group: the same call as padded
        del setups["padded_grouped"], kernels["padded_grouped"]
    before, started = graphs(), time.perf_counter()
    try:
        kernels["flex"]()  # compiles when this shape is new to it
    except Exception as error:  # the failure is the result
        del kernels["flex"]
        flex_first = {"error": str(error).splitlines()[0][:300]}
    else:
        flex_first = {"first_call_s": round(time.perf_counter() - started, 3)}
        flex_first["compiles"] = graphs() - before
        flex_first["plans_first_s"] = mask_first_s
    want = kernels["reference"]().float()
    diffs = {n: (k().float() - want).abs().max().item() for n, k in kernels.items()}
    times = {name: [] for name in [*kernels, *(f"setup_{s}" for s in setups)]}
    for r in range(rounds):
        names = list(kernels)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(kernels[name], inner))
        for name, setup in setups.items():
            times[f"setup_{name}"].append(timed(setup, 1))
    picked = {name: [sample[clock] for sample in values] for name, values in times.items()}
    found = summarize(case, shape, picked, diffs, flex_first)
    return found | {"sdpa_backends": backend_probe(case, plans["padded"])}


def summarize(case, shape: Heads, times: dict, diffs: dict, flex_first: dict) -> dict:
    """Medians and minima (least disturbed by other load) of the times, in ms."""
    wall = {name: [t * 1e3 for t in values] for name, values in times.items()}
    med = {name: statistics.median(values) for name, values in wall.items()}
    low = {name: min(values) for name, values in wall.items()}
    kernels = {}
    for name in diffs:
        paired = zip(wall[name], wall["reference"], strict=True)
        kernels[name] = {
            "ms": round(med[name], 4),
            "ms_min": round(low[name], 4),
            "ratio": round(statistics.median(t / r for t, r in paired), 3),
            "ratio_min": round(low[name] / low["reference"], 3),
            "max_abs_diff": float(f"{diffs[name]:.3g}"),
        }
    steps = {"median": {}, "min": {}}
    for name in ("reference", "padded", "padded_expanded", "padded_grouped", "flex"):
        if name in diffs:
            setup = "setup_padded" if name == "padded_expanded" else f"setup_{name}"
            kernels[name]["setup_ms"] = round(med[setup], 4)
            kernels[name]["setup_ms_min"] = round(low[setup], 4)
            if name == "flex":
                kernels[name]["setup_eager_mask_ms"] = round(med["setup_flex_eager_mask"], 4)
            for stat, ms in (("median", med), ("min", low)):
                steps[stat][name] = ms[setup] + shape.layers * ms[name]
    news = [s.new for s in case.seqs]
    lengths = [s.past + s.new for s in case.seqs]
    real = sum(n * m for n, m in zip(news, lengths, strict=True))
    return {
        "B": len(case.seqs),
        "T": sum(news),
        "sum_L": sum(lengths),
        "padded_cells_per_real": round(len(news) * max(news) * max(lengths) / real, 2),
        "kernels": kernels,
        "step_ms_all_layers": {
            stat: {n: round(v, 3) for n, v in found.items()} for stat, found in steps.items()
        },
        "step_ratio_all_layers": {
            stat: {n: round(v / found["reference"], 3) for n, v in found.items()}
            for stat, found in steps.items()
        },
        "flex_first_call": flex_first,
    }


def recompile_run(dynamic: bool | None, count: int, device: str) -> dict:
    """Compiles of a fresh torch.compile(flex_attention) over `count` engine-like steps."""
    torch.set_num_threads(1)  # steady times are CPU times of this thread
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 8  # the default
    flex = torch.compile(flex_attention, dynamic=dynamic)
    calls = []
    for step in range(count):
        b = 1 + step % 4
        seqs = [
            Seq(500 + 3 * step + i, TREE if step % 2 else 1, tree=bool(step % 2)) for i in range(b)
        ]
        case = make_case(
            seqs, MODELS["qwen2.5-coder-1.5b"], torch.bfloat16, seed=step, device=device
        )
        plan = packed_plan(case)
        before, started = graphs(), time.perf_counter()
        try:
            packed_flex(case, plan, flex)
        except Exception as error:  # the failure is the result
            calls.append({"T": case.q.shape[0], "error": str(error).splitlines()[0][:300]})
            break
        first = time.perf_counter() - started
        steady = min(timed(lambda c=case, p=plan: packed_flex(c, p, flex), 1)[1] for _ in range(5))
        calls.append(
            {
                "T": case.q.shape[0],
                "sum_L": plan.slots.shape[0],
                "compiles": graphs() - before,
                "first_call_s": round(first, 3),
                "steady_cpu_ms_min": round(steady * 1e3, 3),
            }
        )
        print(f"  dynamic={dynamic} {calls[-1]}", flush=True)
    return {
        "dynamic": str(dynamic),
        "compiles": sum(c.get("compiles", 0) for c in calls),
        "compile_s": round(sum(c.get("first_call_s", 0) for c in calls), 1),
        "calls": calls,
    }


def run_all(threads: int, args, rounds: int, inner: int) -> dict:
    """Every case with `threads` torch threads; on the CPU one thread is timed by its CPU
    time, on a device every run by the wall clock (the kernels' time is the device's)."""
    torch.set_num_threads(threads)
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64  # one wrapper serves every case below
    flex = torch.compile(flex_attention, dynamic=False)  # dynamic shapes fail to build here
    clock = 1 if threads == 1 and args.device == "cpu" else 0
    cases = []
    for model in ["qwen2.5-coder-1.5b"] if args.quick else list(MODELS):
        for dtype in args.dtypes.split(","):
            for step, seqs in steps(args.quick).items():
                found = run_case(
                    seqs, MODELS[model], DTYPES[dtype], flex, rounds, inner, clock, args.device
                )
                cases.append({"model": model, "dtype": dtype, "step": step, **found})
                print(threads, model, dtype, step, found["step_ratio_all_layers"], flush=True)
    clock_name = "CPU time of the calling thread" if clock else "wall (device synchronised)"
    return {"clock": clock_name, "summary": summary(cases), "cases": cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 steps, 1 model, few rounds")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--inner", type=int, default=2, help="calls per timed sample")
    p.add_argument("--threads", default="2,1", help="torch thread counts, one run each")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtypes", default="bfloat16,float32", help="of " + ", ".join(DTYPES))
    p.add_argument(
        "--no-recompiles",
        action="store_true",
        help="leave out the count of FlexAttention compiles as shapes change",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    if torch.device(args.device).index is not None:  # "cuda" alone: the current device
        torch.cuda.set_device(torch.device(args.device))
    rounds, inner = (3, 1) if args.quick else (args.rounds, args.inner)
    cache = tempfile.TemporaryDirectory(prefix="attention-kernels-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # cold compiles
    load = [os.getloadavg()[0]]
    runs = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        runs[f"threads_{threads}"] = run_all(threads, args, rounds, inner)
    recompiles = []
    if not args.no_recompiles:
        count = 4 if args.quick else 10
        recompiles = [recompile_run(d, count, args.device) for d in (False, None, True)]
    probe = make_case(
        [Seq(512, 1), Seq(512, TREE, tree=True)],
        MODELS["smollm2-135m"],
        torch.float32,
        device=args.device,
    )
    report = {
        "command": "python -m benchmarks.attention_kernels"
        + (" --quick" if args.quick else f" --rounds {rounds} --inner {inner}")
        + f" --threads {args.threads} --device {args.device} --dtypes {args.dtypes}"
        + (" --no-recompiles" if args.no_recompiles else ""),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "load_average_1min": [*load, os.getloadavg()[0]],  # at start, at end
        "summaries": {name: run["summary"] for name, run in runs.items()},
        "flex_recompiles": recompiles,
        "nested_jagged_sdpa": nested_probe(probe),
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "attention_kernels_quick.json" if args.quick else "attention_kernels.json"
    (out / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summaries"], indent=1))
    cache.cleanup()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.machine()


def summary(cases: list[dict]) -> dict:
    """Per kind of step (decode, tree, mixed): the median over its cases of the per-step
    (all layers, setup included) ratio to the reference, from median and from minimum times."""
    found = {}
    for kind in ("decode", "tree", "mixed"):
        rows = [c for c in cases if c["step"].startswith(kind)]
        found[kind] = {}
        for stat in ("median", "min"):
            for name in ("padded", "padded_expanded", "padded_grouped", "flex"):
                ratios = [c["step_ratio_all_layers"][stat].get(name) for c in rows]
                ratios = [r for r in ratios if r is not None]
                value = round(statistics.median(ratios), 3) if ratios else None
                found[kind][f"{name}_{stat}"] = value
    firsts = [c["flex_first_call"].get("first_call_s") for c in cases]
    firsts = [f for f in firsts if f is not None]
    found["flex_compile_s"] = {
        "count": len(firsts),
        "median": statistics.median(firsts) if firsts else None,
    }
    return found


if __name__ == "__main__":
    main()
