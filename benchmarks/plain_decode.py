"""Plain decode speed of the default target through the whole cluster vs. Hugging Face generate.

Same prompt, same dtype, same device and thread count, measured one after the other in one run:
    python -m benchmarks.plain_decode [--dtype bfloat16] [--tokens 64] [--device cuda]
                                      [--target DIR] [--out DIR]
Cluster tokens/s = completion tokens / decode time reported by the verifier (first to last
token); HF tokens/s = (new tokens - 1) / (generate time - time of a 1-token generate).
--target: a Hugging Face model directory instead of the default target (a stand-in of the same
shape with random weights measures the same speed where the weights cannot be fetched).
--out: also writes DIR/plain_decode.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import grpc
import torch

from specserve.common.settings import ModelRef, ServiceSettings
from specserve.engine import models
from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring."


def cluster_rate(args) -> dict:
    model = {"path": args.target} if args.target else {}
    config = {
        "gateway": {"model": model},
        "verifier": {
            "model": model,
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": 1,
            "interactive_reserved_slots": 0,
            "torch_threads": args.threads,
        },
        "drafter": {"proposer": "ngram"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(config), Path(tmp))
        started = time.monotonic()
        try:
            cluster.start(timeout=600)
            ready_s = time.monotonic() - started
            with grpc.insecure_channel(cluster.procs["gateway"].address) as ch:
                stub = generation_pb2_grpc.GenerationServiceStub(ch)
                req = generation_pb2.GenerateRequest(max_tokens=args.tokens)
                req.messages.messages.add(role="user", content=PROMPT)
                ids, final = [], None
                for chunk in stub.Generate(req, timeout=900):
                    ids.extend(chunk.token_ids)
                    final = chunk.final if chunk.HasField("final") else final
        finally:
            cluster.stop()
    decode_s = final.timings.decode_ms / 1000
    return {
        "ready_s": round(ready_s, 1),
        "tokens": len(ids),
        "ttft_ms": round(final.timings.ttft_ms),
        "ids": ids,
        "tokens_per_s": round((len(ids) - 1) / decode_s, 2),
        "version": final.model_version,
    }


def hf_rate(args) -> dict:
    torch.set_num_threads(args.threads)
    ref = ModelRef(path=args.target) if args.target else ModelRef()
    path, _ = models.resolve(ref, ServiceSettings.load(None).model_cache_dir)
    tok = models.load_tokenizer(path)
    model = models.load_model(path, args.device, args.dtype)
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text).input_ids

    def run(n: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        new = hf_greedy(model, ids, n, pad_token_id=tok.eos_token_id)
        return time.perf_counter() - t, new

    run(1)  # warm-up: the first pass on a GPU also loads its kernels
    first_s, _ = run(1)  # prefill + first token
    total_s, new = run(args.tokens)
    return {
        "tokens": len(new),
        "ids": new,
        "tokens_per_s": round((len(new) - 1) / (total_s - first_s), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both systems)")
    p.add_argument("--target", help="model directory (default: the catalog's default target)")
    p.add_argument("--out", help="directory to write plain_decode.json to")
    args = p.parse_args()
    c = cluster_rate(args)
    h = hf_rate(args)
    n = min(len(c["ids"]), len(h["ids"]))
    report = {
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": args.device,
        "target_version": c["version"],
        "dtype": args.dtype,
        "threads": args.threads,
        "max_tokens": args.tokens,
        "cluster_tokens_per_s": c["tokens_per_s"],
        "hf_generate_tokens_per_s": h["tokens_per_s"],
        "ratio_cluster_over_hf": round(c["tokens_per_s"] / h["tokens_per_s"], 3),
        "cluster_ttft_ms": c["ttft_ms"],
        "cluster_start_s": c["ready_s"],
        "same_tokens": c["ids"][:n] == h["ids"][:n],
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plain_decode.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
