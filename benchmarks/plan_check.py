"""`specserve plan`'s bounds for this machine against a decode and a prefill measured here.

    python -m benchmarks.plan_check [--dtype bfloat16] [--tokens 24] [--prompt-tokens 128]
                                    [--out benchmarks/results] [--strict]

The plan's plain decode ceiling (memory bandwidth / bytes read per step) must be at or above
a greedy Hugging Face decode of the default target, and its time-to-first-token floor (prompt
FLOPs / matrix-multiply FLOP/s) at or below a measured prefill; the estimate is printed next
to the prefill. Bandwidth and FLOP/s are measured on the spot (`measure_this_machine`).
Timings on a shared machine move from run to run, which is why this is a benchmark and not a
unit test. Writes <out>/plan_check.json; --strict exits 1 when a bound does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from specserve.common.settings import ModelRef, ServiceSettings
from specserve.engine import models
from specserve.tools.plan import Load, measure_this_machine, plan, shape_from_dir

PROMPT = [151644, 872, 198, 750, 16326]  # a short chat turn of the default tokenizer


def decode_tokens_per_s(model, tokens: int) -> float:
    """Greedy decode of `tokens` new tokens after a warm-up, timed with perf_counter."""
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm up
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        elapsed = time.perf_counter() - started
    return (out.shape[1] - ids.shape[1]) / elapsed


def prefill_seconds(model, prompt_tokens: int) -> float:
    """One forward pass over `prompt_tokens` random tokens (the last token's logits only)."""
    ids = torch.randint(1000, 20000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:, :16])  # warm up
        started = time.perf_counter()
        model(ids, logits_to_keep=1)
        return time.perf_counter() - started


def check(args) -> dict:
    torch.set_num_threads(args.threads)
    cache = ServiceSettings.load(None).model_cache_dir
    path, _ = models.resolve(ModelRef(), cache)
    model = models.load_model(path, "cpu", args.dtype)
    shape = shape_from_dir(path)
    decode = decode_tokens_per_s(model, args.tokens)
    prefill = prefill_seconds(model, args.prompt_tokens)
    device = measure_this_machine(dtype=args.dtype)
    decoding = plan(shape, None, device, Load(1, len(PROMPT), args.tokens, dtype=args.dtype))
    ceiling = decoding["plain_decode_ceiling_tokens_s_per_stream"]["value"]
    ttft = plan(shape, None, device, Load(1, args.prompt_tokens, 1, dtype=args.dtype))
    return {
        "decode": {
            "measured_tokens_s": round(decode, 2),
            "ceiling_tokens_s": round(ceiling, 2),
            "holds": decode <= ceiling,
        },
        "prefill": {
            "prompt_tokens": args.prompt_tokens,
            "measured_s": round(prefill, 3),
            "floor_s": round(ttft["ttft_floor_s"]["value"], 3),
            "estimate_s": round(ttft["ttft_estimate_s"]["value"], 3),
            "holds": ttft["ttft_floor_s"]["value"] <= prefill,
        },
        "device": {
            "bandwidth_gb_s": round(device.bandwidth_bytes_s / 1e9, 1),
            "matmul_gflop_s": round(device.flops / 1e9),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens timed")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prefill length timed")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--strict", action="store_true", help="exit 1 when a bound does not hold")
    args = p.parse_args()
    results = check(args)
    report = {
        "command": f"python -m benchmarks.plan_check --dtype {args.dtype} --tokens {args.tokens}"
        f" --prompt-tokens {args.prompt_tokens}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_check.json").write_text(json.dumps(report, indent=2) + "\n")
    d, f = results["decode"], results["prefill"]
    print(
        f"plain decode: measured {d['measured_tokens_s']} tokens/s, ceiling "
        f"{d['ceiling_tokens_s']} ({'holds' if d['holds'] else 'BROKEN'})\n"
        f"prefill of {f['prompt_tokens']} tokens: measured {f['measured_s']} s, floor "
        f"{f['floor_s']} s ({'holds' if f['holds'] else 'BROKEN'}), estimate {f['estimate_s']} s"
        f"\nmatmul {results['device']['matmul_gflop_s']} GFLOP/s, bandwidth "
        f"{results['device']['bandwidth_gb_s']} GB/s"
    )
    if args.strict and not (d["holds"] and f["holds"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
