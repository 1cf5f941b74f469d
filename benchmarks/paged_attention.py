"""The engine's CPU attention kernel (`specserve::paged_attention`) alone, a step's calls over
every layer, by context length and by the tokens a sequence's step adds.

    python -m benchmarks.paged_attention [--label L] [--model target|draft] [--threads 2]
                                         [--contexts 300,1000,2000,4000] [--tokens 1,4,7]
                                         [--layout head|slot]
                                         [--reps 7] [--forward] [--dtype int4]
                                         [--out benchmarks/results/paged_attention.json]

One sequence's step as the engine calls it: for each layer, its queries [tokens, heads,
head_dim] against the sequence's entries in that layer's part of a KV pool laid out as the
engine's ([layers, slots, kv_heads, head_dim] float32 stored head by head, or with --layout
slot slot by slot as before; each layer's entries a few MB, so that a
step reads them from memory as a decode step does, not from a cache a repeated call warmed),
with a tree step's mask (each new token sees the context and the tokens before it) where it
adds more than one token. Shapes: `target` is the default target's (28 layers, 12 heads, 2 KV
heads, head_dim 128), `draft` the default draft model's (24, 14, 2, 64). Each figure is the
median of --reps steps. With --forward, the whole forward pass of the default target (--dtype)
is timed the same way after a prompt of each context length: what the kernel's share is
worth to a decode or chain step. The kernel is built from this checkout's sources, so two
revisions are compared by running this on each in turns; results merge into --out under --label.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from .engine import git_commit, model_path

SHAPES = {"target": (28, 12, 2, 128), "draft": (24, 14, 2, 64)}  # layers, heads, KV heads, d


def step_ms(pool_k, pool_v, queries, slots, mask, rows, reps: int) -> float:
    """The median over `reps` of one step's calls, one per layer, in milliseconds."""
    scale = queries.shape[-1] ** -0.5
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        for layer in range(pool_k.shape[0]):
            torch.ops.specserve.paged_attention(
                queries, pool_k[layer], pool_v[layer], slots, mask, rows, scale
            )
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def forward_cases(args) -> list[dict]:
    """The default target's forward pass (FlatModel, --dtype) of --tokens new tokens after a
    prompt of each --contexts length: the median of --reps steps, each from the same KV."""
    from specserve.common.settings import ModelRef
    from specserve.engine import models
    from specserve.engine.flat_model import FlatModel, Segment

    hf = models.load_model(model_path(ModelRef()), "cpu", args.dtype)
    flat, _ = FlatModel.prepare(
        hf, compile=False, key="--forward", kv_tokens=max(args.contexts) + 64
    )
    cases = []
    for context in args.contexts:
        kv = flat.new_kv()
        for start in range(0, context, 512):  # (prompt chunks, as the verifier feeds them)
            flat.forward(
                [Segment(kv, [100 + i % 5000 for i in range(start, min(context, start + 512))])]
            )
        for tokens in args.tokens:
            times = []
            for _ in range(args.reps):
                kv.truncate(context)
                started = time.perf_counter()
                flat.forward([Segment(kv, list(range(500, 500 + tokens)))])
                times.append(time.perf_counter() - started)
            ms = statistics.median(times) * 1e3
            cases.append({"context": context, "tokens": tokens, "forward_ms": round(ms, 2)})
            print(f"forward, context {context:>5}, {tokens} tokens: {ms:7.2f} ms", flush=True)
        kv.free()
    return cases


def pool_tensor(shape: tuple[int, ...], layout: str, gen: torch.Generator) -> torch.Tensor:
    """A [layers, slots, kv_heads, head_dim] pool tensor of random entries, stored head by
    head as the engine's (`head`) or slot by slot (`slot`, the engine's layout before)."""
    from specserve.engine.kv_cache import head_major

    tensor = head_major(shape, torch.float32, "cpu") if layout == "head" else torch.empty(shape)
    return tensor.copy_(torch.randn(shape, generator=gen))


def run(args) -> dict:
    from specserve.engine import kernels

    kernels.load()
    torch.set_num_threads(args.threads)
    layers, heads, kv_heads, d = SHAPES[args.model]
    slots_total = max(args.contexts) + max(args.tokens)
    gen = torch.Generator().manual_seed(0)
    shape = (layers, slots_total, kv_heads, d)
    pool_k, pool_v = (pool_tensor(shape, args.layout, gen) for _ in range(2))
    none = torch.empty(0, dtype=torch.long)
    cases = []
    for context in args.contexts:
        for tokens in args.tokens:
            length = context + tokens
            slots = torch.arange(length)[None]
            queries = torch.randn(tokens, heads, d, generator=gen)
            mask, rows = none, none
            if tokens > 1:  # a chain's mask: the context, then the new tokens causally
                mask = torch.ones(1, 1, tokens, length, dtype=torch.bool)
                mask[0, 0, :, context:] = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
                rows = torch.arange(tokens)
            ms = step_ms(pool_k, pool_v, queries, slots, mask, rows, args.reps)
            cases.append({"context": context, "tokens": tokens, "step_ms": round(ms, 3)})
            print(f"context {context:>5}, {tokens} tokens: {ms:7.2f} ms a step", flush=True)
    return {
        "model": args.model,
        "shape": dict(
            zip(("layers", "heads", "kv_heads", "head_dim"), SHAPES[args.model], strict=True)
        ),
        "threads": args.threads,
        "layout": args.layout,
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cases": cases,
    } | ({"dtype": args.dtype, "forward": forward_cases(args)} if args.forward else {})


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--label", default="latest", help="the key this run's results merge under")
    p.add_argument("--model", choices=sorted(SHAPES), default="target")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--layout",
        choices=("head", "slot"),
        default="head",
        help="the pool stored head by head (the engine's) or slot by slot (before)",
    )
    p.add_argument("--contexts", type=_ints, default=[300, 1000, 2000, 4000])
    p.add_argument("--tokens", type=_ints, default=[1, 4, 7], help="new tokens a step")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--forward", action="store_true", help="also time the default target's pass")
    p.add_argument("--dtype", default="int4", help="the default target's, with --forward")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/paged_attention.json"))
    args = p.parse_args()
    try:
        result = run(args)
    except Exception as e:  # (the kernels need a C++ compiler and an x86 CPU with AVX2)
        raise SystemExit(f"paged_attention: {type(e).__name__}: {e}") from e
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged[args.label] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {args.out} ({args.label})")


if __name__ == "__main__":
    main()
