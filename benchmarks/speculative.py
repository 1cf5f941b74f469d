"""Single-stream speculative decoding on the default pair, side by side in one run.

    python -m benchmarks.speculative [--tokens 128] [--dtype bfloat16] [--out benchmarks/results]

Three prompt kinds (code generation, prose, code editing with the code in the prompt), greedy,
batch 1. Through the cluster (scheduler, verifier, gateway; the drafter restarted with each
proposer setting): plain decoding, draft-model chains and trees, n-gram. In-process Hugging
Face `generate` on the same models and dtype: plain, `assistant_model`, and
`prompt_lookup_num_tokens=10`. Drafter rows marked int8 quantise the draft model's linear
layers (CPU only); the target is always in --dtype. A drafter's max_depth with
min_path_prob 0.2 (the default) makes "chain <=16" a chain that stops where the draft is unsure.

Decode tokens/s = tokens after the first step / time from the first step to the last, taken at
the client for the cluster; for Hugging Face, (n - 1) / (time of n tokens - time of 1 token).
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

from specserve.common import models
from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
from specserve.local_cluster import LocalCluster, free_port, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

from .prompts import PROMPTS

# name -> (drafter settings, tree size per step); None: speculation off
CHAIN = {"branching": 1, "width": 1}
INT8 = {"dtype": "int8"}
CONFIGS: dict[str, tuple[dict | None, int]] = {
    "plain": (None, 0),
    "draft bf16 chain 4": ({**CHAIN, "max_depth": 4}, 4),
    "draft int8 chain 6": ({**INT8, **CHAIN, "max_depth": 6}, 6),
    "draft int8 chain <=16": ({**INT8, **CHAIN, "max_depth": 16}, 16),
    "draft int8 tree 12": ({**INT8, "branching": 2, "width": 3, "max_depth": 6}, 12),
    "ngram 10": ({"proposer": "ngram", "ngram_depth": 10}, 10),
    "hybrid int8 chain 6 + ngram 10": (
        {**INT8, **CHAIN, "proposer": "hybrid", "max_depth": 6, "ngram_depth": 10},
        10,
    ),
}


def stream(stub, prompt: str, tokens: int, tree_size: int) -> dict:
    mode = common_pb2.SPECULATION_MODE_AUTO if tree_size else common_pb2.SPECULATION_MODE_OFF
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens, speculation=common_pb2.SpeculationOptions(mode=mode)
    )
    if tree_size:
        req.speculation.tree_size = tree_size
    req.messages.messages.add(role="user", content=prompt)
    ids, times, final = [], [], None
    started = time.perf_counter()
    for chunk in stub.Generate(req, timeout=1800):
        ids.extend(chunk.token_ids)
        times.append((time.perf_counter(), len(ids)))
        if chunk.HasField("final"):
            final = chunk.final
    (t_first, n_first), (t_last, n) = times[0], times[-1]
    spec = final.speculation
    return {
        "tokens": n,
        "decode_tokens_per_s": round((n - n_first) / (t_last - t_first), 2),
        "end_to_end_tokens_per_s": round(n / (t_last - started), 2),
        "ttft_ms": round(final.timings.ttft_ms),
        "mean_accepted_length": round(spec.mean_accepted_length, 2),
        "acceptance_rate": round(spec.accepted_tokens / spec.drafted_tokens, 3)
        if spec.drafted_tokens
        else None,
        "fallback_steps": spec.fallback_steps,
        "ids": ids,
    }


def run_cluster(args) -> dict[str, dict[str, dict]]:
    drafter_port = free_port()
    threads = args.threads
    config = {
        "verifier": {
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": 1,
            "torch_threads": threads,
            "speculative_decoding": True,
            "speculation_policy": "fixed",  # the tree shapes measured here, every step
            "drafter_addresses": [f"127.0.0.1:{drafter_port}"],
            "draft_timeout_seconds": 60,
            "breaker_cooldown_seconds": 0,
        },
        "drafter": {"device": args.device, "dtype": args.dtype, "torch_threads": threads},
    }
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(config), Path(tmp))
        try:
            cluster.start(timeout=600, services=("scheduler", "verifier", "gateway"))
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for name, (drafter, tree_size) in CONFIGS.items():
                    if args.only and name != "plain" and not any(o in name for o in args.only):
                        continue
                    if args.device != "cpu" and (drafter or {}).get("dtype") == "int8":
                        continue  # int8 drafts are CPU only
                    if drafter is not None:
                        cluster.config["drafter"] = {**config["drafter"], **drafter}
                        cluster.config_path.write_text(yaml.safe_dump(cluster.config))
                        cluster.start_service("drafter", port=drafter_port)
                        cluster.wait_ready("drafter", 600)
                    stream(stub, "Say hi.", 8, tree_size)  # warm up, connect the drafter
                    results[name] = {}
                    for kind, prompt in PROMPTS.items():
                        results[name][kind] = r = stream(stub, prompt, args.tokens, tree_size)
                        print(
                            f"{name:>14} {kind:>5}: {r['decode_tokens_per_s']:6.2f} tok/s, "
                            f"accepted length {r['mean_accepted_length']}",
                            flush=True,
                        )
                    if drafter is not None:
                        cluster.kill("drafter")
        finally:
            cluster.stop()
    return results


def run_hf(args) -> dict[str, dict[str, dict]]:
    torch.set_num_threads(args.threads)
    cache = ServiceSettings.load(None).model_cache_dir
    target_path, _ = models.resolve(ModelRef(), cache)
    draft_path, _ = models.resolve(DrafterSettings().draft_model, cache)
    tok = models.load_tokenizer(target_path)
    target = models.load_model(target_path, args.device, args.dtype)
    draft = models.load_model(draft_path, args.device, args.dtype)
    variants = {
        "hf plain": {},
        "hf assistant_model": {"assistant_model": draft},
        "hf prompt_lookup 10": {"prompt_lookup_num_tokens": 10},
    }
    results: dict[str, dict[str, dict]] = {}
    for name, extra in variants.items():
        results[name] = {}
        for kind, prompt in PROMPTS.items():
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tok(text).input_ids

            first_s, _ = hf_generate(target, ids, 1, tok.eos_token_id, extra)
            total_s, new = hf_generate(target, ids, args.tokens, tok.eos_token_id, extra)
            results[name][kind] = r = {
                "tokens": len(new),
                "decode_tokens_per_s": round((len(new) - 1) / (total_s - first_s), 2),
                "ids": new,
            }
            print(f"{name:>20} {kind:>5}: {r['decode_tokens_per_s']:6.2f} tok/s", flush=True)
    return results


def hf_generate(model, ids: list[int], n: int, pad: int, extra: dict) -> tuple[float, list[int]]:
    """Seconds for a greedy `generate` of n new tokens, and the new tokens."""
    started = time.perf_counter()
    new = hf_greedy(model, ids, n, pad_token_id=pad, **extra)
    return time.perf_counter() - started, new


def summarise(results: dict[str, dict[str, dict]]) -> None:
    """Adds speedups over each system's own plain decoding, and output agreement."""
    for name, by_kind in results.items():
        base = results["hf plain" if name.startswith("hf") else "plain"]
        for kind, r in by_kind.items():
            r["speedup"] = round(r["decode_tokens_per_s"] / base[kind]["decode_tokens_per_s"], 2)
            n = min(len(r["ids"]), len(base[kind]["ids"]))
            r["same_tokens_as_plain"] = r["ids"][:n] == base[kind]["ids"][:n]


def chart(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, kinds = list(results), list(PROMPTS)
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        values = [results[n][kind]["decode_tokens_per_s"] for n in names]
        bars = ax.bar([x + i * width for x in range(len(names))], values, width, label=kind)
        ax.bar_label(bars, labels=[f"{results[n][kind]['speedup']}x" for n in names], fontsize=7)
    ax.set_xticks([x + width for x in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s (label: speedup over own plain)")
    ax.set_title("Single stream, greedy, default pair on this machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--skip-hf", action="store_true", help="only the cluster rows")
    p.add_argument(
        "--only", nargs="*", default=[], help="cluster rows whose name contains one of these"
    )
    args = p.parse_args()
    results = run_cluster(args)
    if not args.skip_hf:
        results |= run_hf(args)
    summarise(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": f"python -m benchmarks.speculative --tokens {args.tokens} --dtype {args.dtype}"
        f" --device {args.device}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, "
        f"device {args.device}",
        "dtype": args.dtype,
        "max_tokens": args.tokens,
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
