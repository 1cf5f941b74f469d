"""Single-stream speculative decoding on the default pair, side by side in one run.

    python -m benchmarks.speculative [--tokens 128] [--dtype bfloat16] [--out benchmarks/results]
                                     [--kinds code prose edit] [--only NAME ...] [--skip-hf]
                                     [--device cuda] [--target DIR --draft DIR]

Three prompt kinds (code generation, prose, code editing with the code in the prompt), greedy,
batch 1. Through the cluster (scheduler, verifier, gateway; the drafter restarted with each
proposer setting): plain decoding, draft-model chains and trees, n-gram. In-process Hugging
Face `generate` on the same models: plain, `assistant_model` with the draft in --dtype and in
int8 (like for like with each of our drafter rows), and `prompt_lookup_num_tokens=10`. The
target is always in --dtype. A drafter's max_depth with min_path_prob 0.2 (the default) makes
"chain <=16" a chain that stops where the draft is unsure.

Labels say what ran, not what was asked for: a drafter row's dtype is the one the running
drafter reports in the registry, an HF assistant's is read off the loaded model, and each
cluster row records the served version (target name, weights, dtype, device) of its output.

Every system is timed the same way: one warm-up request ("Say hi.", 8 tokens) before its rows,
then per prompt the arrival time of each token at the client (the gRPC stream; an HF
`streamer`), on one clock (time.perf_counter). Decode tokens/s = tokens after the first
arrival / time from the first arrival to the last; TTFT = first arrival - start.
--target / --draft: Hugging Face model directories instead of the default pair (stand-ins of
the same shapes with random weights time the same passes, but their drafts are rarely
accepted: such rows measure the cost of speculation, not its gain). --dtype int8 or int4
quantises the target and every drafter (weight-only, services/engine/quant.py); it times the
cluster rows only (--skip-hf).
Writes <out>/speculative.json and <out>/speculative.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import grpc
import torch
import yaml
from transformers.generation.streamers import BaseStreamer

from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
from specserve.engine import models
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster, free_port, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

from .prompts import PROMPTS

WARM_UP = ("Say hi.", 8)
SHORT = {
    "auto": "auto",
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "int8": "int8",
    "int4": "int4",
}
# label -> (drafter settings, tree size per step); 0: speculation off; None: not pinned, the
# verifier's adaptive policy chooses (budget within verification_tree_size for the draft
# model, deep budget within deep_tree_size for model-free trees). {dtype} becomes the dtype
# the running drafter reports; a drafter without "dtype" here runs in --dtype.
CHAIN = {"branching": 1, "width": 1}
INT8 = {"dtype": "int8"}
CONFIGS: dict[str, tuple[dict | None, int | None]] = {
    "plain": (None, 0),
    "draft {dtype} chain 4": ({**CHAIN, "max_depth": 4}, 4),
    "draft {dtype} chain 6": ({**INT8, **CHAIN, "max_depth": 6}, 6),
    "draft {dtype} chain <=16": ({**INT8, **CHAIN, "max_depth": 16}, 16),
    "draft {dtype} tree 12": ({**INT8, "branching": 2, "width": 3, "max_depth": 6}, 12),
    "ngram 10": ({"proposer": "ngram", "ngram_depth": 10}, 10),
    "suffix, adaptive": ({"proposer": "suffix"}, None),
    # config/specserve.yaml's drafter and policy (with --dtype auto, its dtypes too): the draft
    # model's chain of 6, and the suffix tree wherever it is expected to have more accepted.
    "default: hybrid, suffix + draft {dtype} chain 6, adaptive": (
        {**CHAIN, "proposer": "hybrid", "max_depth": 6},
        None,
    ),
    "default + run-ahead": (
        {**CHAIN, "proposer": "hybrid", "max_depth": 6, "run_ahead": True},
        None,
    ),
}


def timing(started: float, arrivals: list[tuple[float, int]]) -> dict:
    """Figures from token arrivals (perf_counter time, tokens so far), the same for every
    system: decode rate after the first arrival, end to end rate, time to first token."""
    (t_first, n_first), (t_last, n) = arrivals[0], arrivals[-1]
    return {
        "tokens": n,
        "decode_tokens_per_s": round((n - n_first) / (t_last - t_first), 2)
        if t_last > t_first
        else None,
        "end_to_end_tokens_per_s": round(n / (t_last - started), 2),
        "ttft_ms": round((t_first - started) * 1000),
    }


def stream(stub, prompt: str, tokens: int, tree_size: int | None) -> dict:
    mode = common_pb2.SPECULATION_MODE_OFF if tree_size == 0 else common_pb2.SPECULATION_MODE_AUTO
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens, speculation=common_pb2.SpeculationOptions(mode=mode)
    )
    if tree_size:
        req.speculation.tree_size = tree_size
    req.messages.messages.add(role="user", content=prompt)
    ids, arrivals, final = [], [], None
    started = time.perf_counter()
    for chunk in stub.Generate(req, timeout=1800):
        if chunk.token_ids:
            ids.extend(chunk.token_ids)
            arrivals.append((time.perf_counter(), len(ids)))
        if chunk.HasField("final"):
            final = chunk.final
    spec = final.speculation
    return timing(started, arrivals) | {
        "mean_accepted_length": round(spec.mean_accepted_length, 2),
        "acceptance_rate": round(spec.accepted_tokens / spec.drafted_tokens, 3)
        if spec.drafted_tokens
        else None,
        "fallback_steps": spec.fallback_steps,
        "target_version": final.model_version,
        "ids": ids,
    }


def running_drafter_dtype(store: RequestStore, address: str, proposer: str) -> str:
    """The dtype the drafter at `address` reports in the registry (what it loaded)."""
    rows = [d for d in store.live("drafter") if d.get("address") == address]
    if not rows or rows[0].get("proposer") != proposer:
        raise RuntimeError(f"no {proposer} drafter registered at {address}: {rows}")
    return rows[0]["dtype"]


def start_drafter(cluster: LocalCluster, settings: dict, port: int) -> str:
    """(Re)starts the drafter with `settings`; returns the dtype it reports running in."""
    cluster.config["drafter"] = settings
    cluster.config_path.write_text(yaml.safe_dump(cluster.config))
    cluster.start_service("drafter", port=port)
    cluster.wait_ready("drafter", 600)
    store = RequestStore.from_url(cluster.redis_url)
    proposer = settings.get("proposer", DrafterSettings().proposer)
    return running_drafter_dtype(store, f"127.0.0.1:{port}", proposer)


def wanted(label: str, args) -> bool:
    """Whether --only asks for the row `label` (each system's plain row always runs)."""
    return not args.only or label in ("plain", "hf plain") or any(o in label for o in args.only)


def run_cluster(args) -> dict[str, dict[str, dict]]:
    drafter_port = free_port()
    threads = args.threads
    target = {"path": args.target} if args.target else {}
    draft = {"draft_model_path": args.draft} if args.draft else {}
    config = {
        "gateway": {"model": target},
        "verifier": {
            "model": target,
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": 1,
            "interactive_reserved_slots": 0,
            "torch_threads": threads,
            "speculative_decoding": True,
            # Rows that pin a tree size get it every step; the others the adaptive policy's.
            "speculation_policy": "adaptive",
            "verification_tree_size": 6,  # as config/specserve.yaml (unpinned rows)
            "drafter_addresses": [f"127.0.0.1:{drafter_port}"],
            "draft_timeout_seconds": 60,
            "breaker_cooldown_seconds": 0,
        },
        "drafter": {"device": args.device, "dtype": args.dtype, "torch_threads": threads} | draft,
    }
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(config), Path(tmp))
        try:
            cluster.start(timeout=600, services=("scheduler", "verifier", "gateway"))
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                for template, (drafter, tree_size) in CONFIGS.items():
                    asked = SHORT[(drafter or {}).get("dtype", args.dtype)]
                    if not wanted(template.format(dtype=asked), args):
                        continue
                    label = template
                    if drafter is not None:
                        ran = start_drafter(cluster, {**config["drafter"], **drafter}, drafter_port)
                        label = template.format(dtype=SHORT[ran])
                    stream(stub, WARM_UP[0], WARM_UP[1], tree_size)  # and connect the drafter
                    results[label] = {}
                    for kind in args.kinds:
                        results[label][kind] = r = stream(
                            stub, PROMPTS[kind], args.tokens, tree_size
                        )
                        print(
                            f"{label:>30} {kind:>5}: {r['decode_tokens_per_s']} tok/s, "
                            f"accepted length {r['mean_accepted_length']}",
                            flush=True,
                        )
                    if drafter is not None:
                        cluster.kill("drafter")
        finally:
            cluster.stop()
    return results


class Arrivals(BaseStreamer):
    """An HF `streamer` that notes when each token arrives (the prompt's `put` aside)."""

    def __init__(self):
        self.seen_prompt = False
        self.arrivals: list[tuple[float, int]] = []

    def put(self, value) -> None:
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        total = (self.arrivals[-1][1] if self.arrivals else 0) + value.numel()
        self.arrivals.append((now, total))

    def end(self) -> None:
        pass


def hf_stream(model, ids: list[int], tokens: int, pad: int, extra: dict) -> dict:
    """A greedy `generate`, timed as the cluster's streams are."""
    clock = Arrivals()
    started = time.perf_counter()
    new = hf_greedy(model, ids, tokens, pad_token_id=pad, streamer=clock, **extra)
    return timing(started, clock.arrivals) | {"ids": new}


def run_hf(args) -> dict[str, dict[str, dict]]:
    torch.set_num_threads(args.threads)
    cache = ServiceSettings.load(None).model_cache_dir
    target_ref = ModelRef(path=args.target) if args.target else ModelRef()
    draft_ref = ModelRef(path=args.draft) if args.draft else DrafterSettings().draft_model
    target_path, _ = models.resolve(target_ref, cache)
    draft_path, _ = models.resolve(draft_ref, cache)
    tok = models.load_tokenizer(target_path)
    target = models.load_model(target_path, args.device, args.dtype)
    variants = {"hf plain": {}}
    for dtype in (args.dtype, "int8"):  # only the drafts a row asks for are loaded
        if wanted(f"hf assistant_model (draft {SHORT[dtype]})", args):
            draft = models.load_model(draft_path, args.device, dtype)
            # labelled by the dtype the loaded draft runs in
            variants[f"hf assistant_model (draft {SHORT[models.loaded_dtype(draft)]})"] = {
                "assistant_model": draft
            }
    variants["hf prompt_lookup 10"] = {"prompt_lookup_num_tokens": 10}

    def chat(prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text).input_ids

    results: dict[str, dict[str, dict]] = {}
    for name, extra in variants.items():
        if not wanted(name, args):
            continue
        hf_stream(target, chat(WARM_UP[0]), WARM_UP[1], tok.eos_token_id, extra)
        results[name] = {}
        for kind in args.kinds:
            ids = chat(PROMPTS[kind])
            results[name][kind] = r = hf_stream(target, ids, args.tokens, tok.eos_token_id, extra)
            print(f"{name:>30} {kind:>5}: {r['decode_tokens_per_s']} tok/s", flush=True)
    return results


def summarise(results: dict[str, dict[str, dict]]) -> None:
    """Adds speedups over each system's own plain decoding, and output agreement."""
    for name, by_kind in results.items():
        base = results["hf plain" if name.startswith("hf") else "plain"]
        for kind, r in by_kind.items():
            own, plain = r["decode_tokens_per_s"], base[kind]["decode_tokens_per_s"]
            r["speedup"] = round(own / plain, 2) if own and plain else None
            n = min(len(r["ids"]), len(base[kind]["ids"]))
            r["same_tokens_as_plain"] = r["ids"][:n] == base[kind]["ids"][:n]


def chart(results: dict[str, dict[str, dict]], path: Path) -> None:
    """The chart, where matplotlib is installed (a GPU machine's image may lack it; the JSON
    holds every figure)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, kinds = list(results), list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        values = [results[n][kind]["decode_tokens_per_s"] or 0 for n in names]
        bars = ax.bar([x + i * width for x in range(len(names))], values, width, label=kind)
        speedups = [results[n][kind]["speedup"] for n in names]
        ax.bar_label(bars, labels=[f"{x}x" if x else "n/a" for x in speedups], fontsize=7)
    ax.set_xticks([x + width for x in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s (label: speedup over own plain)")
    ax.set_title("Single stream, greedy, default pair on this machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["auto", "float32", "bfloat16", "int8", "int4"],
        help="target and drafter (int8, int4: weight-only quantised; auto: what the device runs "
        "fastest, as config/specserve.yaml; these three: cluster rows only)",
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (every system)")
    p.add_argument("--target", help="target model directory (default: the catalog's)")
    p.add_argument("--draft", help="draft model directory (default: the catalog's)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--skip-hf", action="store_true", help="only the cluster rows")
    p.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="rows whose label contains one of these (the plain rows always run)",
    )
    p.add_argument("--kinds", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    args = p.parse_args()
    if args.dtype in ("auto", "int8", "int4") and not args.skip_hf:
        p.error(f"--dtype {args.dtype} runs the cluster rows only: add --skip-hf")
    results = run_cluster(args)
    if not args.skip_hf:
        results |= run_hf(args)
    summarise(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": f"python -m benchmarks.speculative --tokens {args.tokens} --dtype {args.dtype}"
        f" --device {args.device} --kinds {' '.join(args.kinds)}"
        + (f" --only {' '.join(args.only)}" if args.only else "")
        + (" --skip-hf" if args.skip_hf else "")
        + (f" --target {args.target} --draft {args.draft}" if args.target or args.draft else ""),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, "
        f"device {args.device}",
        "dtype": args.dtype,
        "max_tokens": args.tokens,
        "timing": f"every system: one warm-up request {WARM_UP}, then per prompt token "
        "arrivals at the client on time.perf_counter; decode tokens/s = tokens after the "
        "first arrival / (last arrival - first arrival)",
        "results": {
            n: {k: {f: v for f, v in r.items() if f != "ids"} for k, r in by.items()}
            for n, by in results.items()
        },
    }
    (out / "speculative.json").write_text(json.dumps(report, indent=2))
    chart(results, out / "speculative.png")
    print(json.dumps(report["results"], indent=1))


if __name__ == "__main__":
    main()
