"""One rank against two: the default target over 1 rank x T threads and N ranks x T/N threads.

    python -m benchmarks.tensor_parallel [--ranks 2] [--threads 2] [--dtype float32]
                                         [--device cpu] [--reps 3] [--target DIR]

Both configurations run the same FlatModel passes, timed the same way in this process (rank 0;
the other ranks are the verifier's own rank processes, verifier/ranks.py):
  decode   greedy decode steps after a 64-token prompt: tokens/s;
  tree     one verify step of 1 pending token + an 8-node chain: ms;
  prefill  a 256-token prompt in one pass: ms;
  memory   each rank's weight bytes, and each rank process's resident memory after the runs.
Each timed figure is the median of --reps repetitions (min and max beside it). The one-rank
model is freed before the ranks start, so the two never share the machine's memory or cores.
Results go to benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from benchmarks.engine import spread
from specserve.common.settings import ModelRef, ServiceSettings
from specserve.engine import models
from specserve.engine.flat_model import FlatModel, Segment
from specserve.verifier.ranks import Ranks

OUT = Path(__file__).parent / "results" / "tensor_parallel.json"
DECODE_STEPS = 32


def rss_bytes(pid: str | int = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(flat: FlatModel, vocab: int, reps: int) -> dict:
    """The timed passes of one configuration."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (64,), generator=gen).tolist()
    long_prompt = torch.randint(vocab, (256,), generator=gen).tolist()
    decode, tree, prefill = [], [], []
    for _ in range(reps + 1):  # (the first round warms up and is not kept)
        kv = flat.new_kv()
        (rows,) = flat.forward([Segment(kv, prompt)])
        token = int(rows[-1].argmax())
        started = time.perf_counter()
        for _ in range(DECODE_STEPS):
            (rows,) = flat.forward([Segment(kv, [token])])
            token = int(rows[-1].argmax())
        decode.append(DECODE_STEPS / (time.perf_counter() - started))
        started = time.perf_counter()
        flat.forward([Segment(kv, [token] + prompt[:8], logits_from=0)])
        tree.append((time.perf_counter() - started) * 1000)
        kv.free()
        kv = flat.new_kv()
        started = time.perf_counter()
        flat.forward([Segment(kv, long_prompt)])
        prefill.append((time.perf_counter() - started) * 1000)
        kv.free()
    return {
        "decode_tokens_s": spread(decode[1:]),
        "tree_step_ms": spread(tree[1:]),
        "prefill_256_ms": spread(prefill[1:]),
    }


def one_rank(path: Path, args, vocab: int) -> dict:
    torch.set_num_threads(args.threads)
    whole = models.load_model(path, args.device, args.dtype)
    row = {
        "config": f"1 rank x {args.threads} threads",
        "ranks": 1,
        "threads_per_rank": args.threads,
    }
    row |= measure(FlatModel(whole), vocab, args.reps)
    row["weight_bytes_per_rank"] = [models.weight_bytes(whole)]
    row["rss_bytes_per_rank"] = [rss_bytes()]
    return row


def many_ranks(path: Path, args, vocab: int) -> dict:
    per_rank = max(1, args.threads // args.ranks)
    torch.set_num_threads(per_rank)
    settings = types.SimpleNamespace(
        tensor_parallel=args.ranks,
        tensor_parallel_timeout_seconds=300,
        dtype=args.dtype,
        device=args.device,
        torch_threads=per_rank,
        compile=False,
        log_level="WARNING",
    )
    ranks = Ranks.launch(path, settings)
    try:
        shard = models.load_model(path, args.device, args.dtype, shard=(0, args.ranks))
        loaded = {0: models.weight_bytes(shard), **ranks.loaded()}
        row = {
            "config": f"{args.ranks} ranks x {per_rank} thread(s)",
            "ranks": args.ranks,
            "threads_per_rank": per_rank,
        }
        row |= measure(FlatModel(shard, shards=ranks.shards), vocab, args.reps)
        row["weight_bytes_per_rank"] = [loaded[r] for r in sorted(loaded)]
        row["rss_bytes_per_rank"] = [rss_bytes()] + [rss_bytes(p.pid) for p in ranks.procs]
        return row
    finally:
        ranks.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="threads in all, split over ranks")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--target", type=Path, help="a model directory instead of the default")
    parser.add_argument("--only", choices=["one", "many"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = args.target or models.resolve(ModelRef(), ServiceSettings.load(None).model_cache_dir)[0]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    if args.only:  # one configuration, in a process of its own (its memory its own)
        row = (one_rank if args.only == "one" else many_ranks)(path, args, vocab)
        print(json.dumps(row), flush=True)
        return 0
    rows = []
    for only in ("one", "many"):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.tensor_parallel", *sys.argv[1:], "--only", only],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    one, many = rows
    result = {
        "command": "python -m benchmarks.tensor_parallel "
        f"--ranks {args.ranks} --threads {args.threads} --dtype {args.dtype} "
        f"--device {args.device} --reps {args.reps}",
        "model": path.name if args.target else ModelRef().label,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "rows": rows,
        f"decode_{args.ranks}_ranks_over_1": round(
            many["decode_tokens_s"]["median"] / one["decode_tokens_s"]["median"], 3
        ),
        "weights_per_rank_over_1_rank": round(
            max(many["weight_bytes_per_rank"]) / one["weight_bytes_per_rank"][0], 3
        ),
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
