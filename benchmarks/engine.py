"""The engine's cost at the level of its forward pass (FlatModel, ModelRunner; no cluster).

    python -m benchmarks.engine --label before [--dtype bfloat16] [--threads 2]
                                [--attention auto|padded|paged] [--module-layers]
                                [--parts decode,tiny,tree,ttft,batch] [--reps 5]
                                [--device cuda] [--target DIR] [--tiny DIR]

Parts (each figure the median of --reps repetitions, with min and max to show the noise):
  decode  plain greedy decode of the default target: tokens/s over --steps steps after a short
          prompt, against the ceiling = memory bandwidth / weight bytes read per token.
  tiny    SmolLM2-135M decode step time against its weight-read time (weight bytes /
          bandwidth): the engine's fixed costs per step (`specserve models fetch
          smollm2-135m-instruct@0.1.2` first).
  tree    one verify step of a 16-node draft tree (+ 1 pending token) against one of the
          pending token alone, default target, context ~200 tokens.
  ttft    time to first token of a 400-token prompt: its prefill in chunks of the verifier's
          max_prefill_tokens, then the first token's argmax.
  batch   default-target decode step time with batch 1, 4 and 8 (one token each).
  compile (only when asked for) SmolLM2-135M and the default target, each with an eager and
          a compiled forward over the same weights, decode steps timed in turns.
Bandwidth is measured on the spot as `specserve plan` does (a copy of a 1 GiB tensor, bytes
read + written per second) with --threads threads, on --device. Results merge into --out under
--label, so that runs of several versions of the engine stay side by side. --target and --tiny
take model directories instead of the catalog's (stand-ins of the same shapes with random
weights, where the weights cannot be fetched, time the same passes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from specserve.common.settings import ModelRef, ServiceSettings, VerifierSettings
from specserve.engine import models
from specserve.engine.flat_model import FlatModel, Segment
from specserve.speculation.sampling import SamplingParams
from specserve.speculation.tree import DraftTree
from specserve.tools.plan import measure_this_machine
from specserve.verifier.runner import ModelRunner
from specserve.verifier.sequence import Committed, Sequence

from . import machine

PARTS = ("decode", "tiny", "tree", "ttft", "batch")
ASKED_ONLY = ("compile",)  # not in the default --parts
TINY = ModelRef(name="smollm2-135m-instruct", version="0.1.2")
PROMPT = "Write a Python function that checks whether a string is a palindrome."


def spread(samples: list[float], digits: int = 4) -> dict:
    """Median, min and max of repeated measurements, and (max - min) / median."""
    mid = statistics.median(samples)
    return {
        "median": round(mid, digits),
        "min": round(min(samples), digits),
        "max": round(max(samples), digits),
        "spread": round((max(samples) - min(samples)) / mid, 3),
        "reps": len(samples),
    }


def synced(device: torch.device) -> None:
    """Waits for the work queued on a CUDA device (a no-op on the CPU). Kernels run
    asynchronously: a clock read right after a call that returns device tensors would time
    only their launch, and leave their run to whatever is timed next."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn` takes, its work on `device` included."""
    synced(device)
    started = time.perf_counter()
    fn()
    synced(device)
    return time.perf_counter() - started


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer once (a tied
    embedding once, as the LM head; a quantised layer's codes and scales are buffers), less
    an untied input embedding, of which a step reads only its rows."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)  # None: quantised, own codes
    if head is None or embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def random_ids(count: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 20000, (count,), generator=gen).tolist()


def chat_prompt(path: Path) -> list[int]:
    """PROMPT as a user turn in the model's chat template: token ids."""
    tok = models.load_tokenizer(path)
    messages = [{"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text).input_ids


def decoder(flat: FlatModel, prompt: list[int]) -> Callable[[int], float]:
    """After a prefill of `prompt`: a function that decodes `steps` greedy tokens and returns
    the seconds per step."""
    kv = flat.new_kv()
    token = int(flat.forward([Segment(kv, prompt)])[0][-1].argmax())

    def decode(steps: int) -> float:
        def run() -> None:
            nonlocal token
            for _ in range(steps):
                token = int(flat.forward([Segment(kv, [token])])[0][-1].argmax())

        return timed(run, flat.device) / steps

    return decode


def decode_reps(flat: FlatModel, prompt: list[int], steps: int, reps: int) -> list[float]:
    """Seconds per step of each repetition (its steps' total / steps), after a warm-up."""
    decoder(flat, prompt)(4)
    return [decoder(flat, prompt)(steps) for _ in range(reps)]


def part_decode(flat: FlatModel, prompt: list[int], bandwidth: float, args) -> dict:
    step = decode_reps(flat, prompt, args.steps, args.reps)
    rates = [1 / s for s in step]
    ceiling = bandwidth / weight_bytes(flat.hf)
    return {
        "steps": args.steps,
        "prompt_tokens": len(prompt),
        "tokens_s": spread(rates, 2),
        "ceiling_tokens_s": round(ceiling, 2),
        "fraction_of_ceiling": round(statistics.median(rates) / ceiling, 3),
        "target_fraction": 0.5,
    }


def model_path(ref: ModelRef) -> Path:
    path, _ = models.resolve(ref, ServiceSettings.load(None).model_cache_dir)
    return path


def tiny_ref(args) -> ModelRef:
    return ModelRef(path=args.tiny) if args.tiny else TINY


def target_ref(args) -> ModelRef:
    return ModelRef(path=args.target) if args.target else ModelRef()


def part_tiny(bandwidth: float, args) -> dict:
    ref = tiny_ref(args)
    path = model_path(ref)
    hf = models.load_model(path, args.device, args.dtype)
    flat = engine_model(hf, args)
    step = decode_reps(flat, chat_prompt(path), args.steps, args.reps)
    read_s = weight_bytes(hf) / bandwidth
    mid = statistics.median(step)
    return {
        "model": ref.label,
        "steps": args.steps,
        "step_ms": spread([s * 1000 for s in step], 2),
        "weight_bytes": weight_bytes(hf),
        "weight_read_ms": round(read_s * 1000, 2),
        "step_over_weight_read": round(mid / read_s, 2),
        "target_ratio": 2.0,
    }


def sequence(prompt: list[int], name: str = "bench") -> Sequence:
    return Sequence(name, prompt, 1 << 20, SamplingParams(), [], "interactive", "0", 0, 0)


def drafted_tree(nodes: int, seed: int) -> DraftTree:
    """A tree shaped like a drafter's: the root and its first children branch in two, each
    branch goes on as a chain; `nodes` nodes breadth first."""
    tree, frontier = DraftTree(), [-1]
    tokens = iter(random_ids(nodes, seed))
    while len(tree) < nodes:
        grown = []
        for parent in frontier:
            for _ in range(2 if parent < 1 else 1):
                if len(tree) < nodes:
                    grown.append(tree.add(next(tokens), parent))
        frontier = grown
    return tree


def part_tree(runner: ModelRunner, args) -> dict:
    seq = sequence(random_ids(args.context, 1))
    runner.verify([seq], [DraftTree()])  # the prompt into the KV cache
    seq.output_ids.append(random_ids(1, 2)[0])  # one pending token
    before = Committed.of(seq)
    tree, empty = drafted_tree(16, 3), DraftTree()

    def step(t: DraftTree) -> float:
        elapsed = timed(lambda: runner.verify([seq], [t]), runner.model.device)
        before.rewind(seq)
        return elapsed

    step(empty), step(tree)  # warm up
    single, wide = [], []
    for _ in range(args.reps):  # interleaved, so that load moves both alike
        single.append(step(empty))
        wide.append(step(tree))
    ratios = [w / s for w, s in zip(wide, single, strict=True)]
    return {
        "context_tokens": args.context + 1,
        "tree_nodes": len(tree),
        "one_token_ms": spread([s * 1000 for s in single], 1),
        "tree_ms": spread([w * 1000 for w in wide], 1),
        "tree_over_one": round(statistics.median(wide) / statistics.median(single), 3),
        "tree_over_one_paired": spread(ratios, 3),
        "target_ratio": 1.3,
    }


def first_token(runner: ModelRunner, prompt: list[int], chunk: int) -> int:
    """Prefills `prompt` in chunks of `chunk` tokens; the first token (argmax)."""
    seq = sequence(prompt)
    while True:
        take = min(chunk, len(prompt) - seq.num_computed)
        rows = runner.verify([seq], [DraftTree()], [take])[0]
        if not seq.prefilling:
            return int(rows[-1].argmax())


def part_ttft(runner: ModelRunner, args) -> dict:
    chunk = VerifierSettings().max_prefill_tokens
    prompt = random_ids(args.prompt_tokens, 4)
    first_token(runner, prompt[:32], chunk)  # warm up
    device = runner.model.device
    samples = [timed(lambda: first_token(runner, prompt, chunk), device) for _ in range(args.reps)]
    return {
        "prompt_tokens": args.prompt_tokens,
        "prefill_chunk_tokens": chunk,
        "ttft_ms": spread([s * 1000 for s in samples], 1),
        "target": "at most half the 'before' figure",
    }


def batch_step_ms(flat: FlatModel, prompt: list[int], batch: int, steps: int) -> float:
    """Median milliseconds of `steps` decode steps of `batch` sequences, each `prompt` and
    a few tokens of its own."""
    kvs = [flat.new_kv() for _ in range(batch)]
    prompts = [prompt + random_ids(3, i) for i in range(batch)]
    rows = flat.forward([Segment(kv, p) for kv, p in zip(kvs, prompts, strict=True)])
    tokens = [int(r[-1].argmax()) for r in rows]
    times = []

    def step(segments: list[Segment]) -> None:
        nonlocal tokens
        rows = flat.forward(segments)
        tokens = [int(r[-1].argmax()) for r in rows]

    for _ in range(steps):
        segments = [Segment(kv, [t]) for kv, t in zip(kvs, tokens, strict=True)]
        times.append(timed(partial(step, segments), flat.device))
    return statistics.median(times) * 1000


def part_batch(flat: FlatModel, prompt: list[int], args) -> dict:
    batch_step_ms(flat, prompt, 2, 2)  # warm up
    sizes = (1, 4, 8)
    runs: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(args.reps):  # each repetition times every size, so load moves all alike
        for b in sizes:
            runs[b].append(batch_step_ms(flat, prompt, b, args.batch_steps))
    one = statistics.median(runs[1])
    return {
        "steps_per_rep": args.batch_steps,
        **{f"batch_{b}_step_ms": spread(runs[b], 1) for b in sizes},
        **{f"batch_{b}_over_batch_1": round(statistics.median(runs[b]) / one, 2) for b in sizes},
    }


def part_compile(args) -> dict:
    """Eager and compiled decode of the same weights in turns of a few steps, so that the
    machine's noise falls on both alike."""
    results = {}
    for name, ref in (("tiny", tiny_ref(args)), ("target", target_ref(args))):
        path = model_path(ref)
        hf = models.load_model(path, args.device, args.dtype)
        compiled, seconds = FlatModel.prepare(hf, compile=True, key="--parts compile")
        prompt = chat_prompt(path)
        eager, fast = decoder(FlatModel(hf), prompt), decoder(compiled, prompt)
        eager(4), fast(4)  # warm up
        turn = max(4, args.steps // 8)
        samples: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.reps * 3):
            samples["eager"].append(eager(turn) * 1000)
            samples["compiled"].append(fast(turn) * 1000)
        results[name] = {
            "model": ref.label,
            "warm_up_s": round(seconds, 1),
            "graphs": compiled.graphs,
            "steps_per_turn": turn,
            "eager_step_ms": spread(samples["eager"], 2),
            "compiled_step_ms": spread(samples["compiled"], 2),
            "compiled_over_eager": round(
                statistics.median(samples["compiled"]) / statistics.median(samples["eager"]), 3
            ),
        }
        del hf, compiled, eager, fast
    return results


def device_name(device: str) -> str:
    """The name of a CUDA device after a comma (", NVIDIA H200"); "" for the CPU."""
    if device == "cpu":
        return ""
    return f", {torch.cuda.get_device_name(torch.device(device))}"


def git_commit() -> str:
    """HEAD's short hash, with "+changes" when the work tree differs from it ("" where there
    is no git, or no repository: a copy of the tree on another machine)."""

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True).stdout.strip()
        except FileNotFoundError:
            return ""

    head = git("rev-parse", "--short=12", "HEAD")
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def engine_model(hf, args) -> FlatModel:
    """The forward under test (--attention's kernel), compiled (and warmed up) with --compile."""
    if not args.compile:
        flat = FlatModel(hf, attention=args.attention)
        if args.module_layers:
            flat.int4_layers = None
        return flat
    flat, seconds = FlatModel.prepare(hf, compile=True, key="--compile", attention=args.attention)
    print(f"compiled and warmed up in {seconds:.1f} s ({flat.graphs} graphs)", flush=True)
    return flat


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = measure_this_machine(dtype=args.dtype, device=args.device)
    bandwidth = device.bandwidth_bytes_s
    results: dict[str, dict] = {}
    if "tiny" in args.parts:
        results["tiny"] = part_tiny(bandwidth, args)
        progress(results, "tiny")
    if {"decode", "tree", "ttft", "batch"} & set(args.parts):
        path = model_path(target_ref(args))
        flat = engine_model(models.load_model(path, args.device, args.dtype), args)
        runner, prompt = ModelRunner(flat), chat_prompt(path)
        if "decode" in args.parts:
            results["decode"] = part_decode(flat, prompt, bandwidth, args)
            progress(results, "decode")
        if "tree" in args.parts:
            results["tree"] = part_tree(runner, args)
            progress(results, "tree")
        if "ttft" in args.parts:
            results["ttft"] = part_ttft(runner, args)
            progress(results, "ttft")
        if "batch" in args.parts:
            results["batch"] = part_batch(flat, prompt, args)
            progress(results, "batch")
    if "compile" in args.parts:
        results["compile"] = part_compile(args)
        progress(results, "compile")
    return {
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "matmul_gflop_s": round(device.flops / 1e9),
        **results,
    }


def progress(results: dict, part: str) -> None:
    """A part's line on stderr as soon as it is measured (a loaded machine takes long)."""
    print(summary({part: results[part]}), file=sys.stderr, flush=True)


def summary(results: dict) -> str:
    lines = [f"bandwidth {results['bandwidth_gb_s']} GB/s"] if "bandwidth_gb_s" in results else []
    if d := results.get("decode"):
        lines.append(
            f"decode: {d['tokens_s']['median']} tokens/s, ceiling {d['ceiling_tokens_s']}: "
            f"{d['fraction_of_ceiling']:.0%} of it (target 50%)"
        )
    if t := results.get("tiny"):
        lines.append(
            f"tiny: step {t['step_ms']['median']} ms, weight read {t['weight_read_ms']} ms: "
            f"{t['step_over_weight_read']}x (target 2x)"
        )
    if t := results.get("tree"):
        lines.append(
            f"tree: {t['tree_nodes']} nodes {t['tree_ms']['median']} ms, 1 token "
            f"{t['one_token_ms']['median']} ms: {t['tree_over_one']}x (target 1.3x)"
        )
    if t := results.get("ttft"):
        lines.append(f"ttft: {t['prompt_tokens']} tokens {t['ttft_ms']['median']} ms")
    if c := results.get("compile"):
        for name, r in c.items():
            lines.append(
                f"compile, {name}: eager {r['eager_step_ms']['median']} ms, compiled "
                f"{r['compiled_step_ms']['median']} ms a step: {r['compiled_over_eager']}x"
            )
    if b := results.get("batch"):
        steps = ", ".join(f"{n}: {b[f'batch_{n}_step_ms']['median']} ms" for n in (1, 4, 8))
        lines.append(f"batch step: {steps}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--label", required=True, help="key of this run in the results file")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--threads", type=int, default=2, help="torch threads (bandwidth too)")
    p.add_argument("--compile", action="store_true", help="torch.compile the forward")
    p.add_argument(
        "--attention",
        choices=("auto", "padded", "paged"),
        default="auto",
        help="attention kernel (verifier.attention)",
    )
    p.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated: {PARTS + ASKED_ONLY}"
    )
    p.add_argument(
        "--module-layers",
        action="store_true",
        help="run the layers one module call at a time, not as one kernel call (int4 on a CPU)",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per figure")
    p.add_argument("--steps", type=int, default=64, help="decode steps per repetition")
    p.add_argument("--batch-steps", type=int, default=8, help="steps per batch repetition")
    p.add_argument("--context", type=int, default=200, help="tree part: prompt tokens")
    p.add_argument("--prompt-tokens", type=int, default=400, help="ttft part: prompt tokens")
    p.add_argument("--out", default="benchmarks/results/engine.json")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--target", help="model directory instead of the default target")
    p.add_argument("--tiny", help=f"model directory instead of {TINY.label}")
    args = p.parse_args()
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if unknown := set(args.parts) - set(PARTS + ASKED_ONLY):
        p.error(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS + ASKED_ONLY)}")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    results = run(args)
    entry = {
        "command": f"python -m benchmarks.engine --label {args.label} --dtype {args.dtype} "
        f"--threads {args.threads} --parts {','.join(args.parts)} --reps {args.reps} "
        f"--steps {args.steps} --device {args.device} --attention {args.attention}"
        + "".join(f" --{k} {v}" for k in ("target", "tiny") if (v := getattr(args, k))),
        "git_commit": git_commit(),
        "dtype": args.dtype,
        "threads": args.threads,
        "compile": args.compile,
        "attention": args.attention,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine() + device_name(args.device),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "seconds": round(time.monotonic() - started),
        "results": results,
    }
    out = Path(args.out)
    merged = json.loads(out.read_text()) if out.is_file() else {}
    merged[args.label] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print(summary(results))


if __name__ == "__main__":
    main()
