"""Plain decode speed and greedy agreement of quantised weights against bfloat16, side by side.

    python -m benchmarks.quant_decode [--model target|draft] [--tokens 64] [--threads 2]
        [--candidates bfloat16,int8,int4,dynamic-int8] [--compile int8,int4] [--out results/x.json]

Every candidate decodes the same chat prompt through FlatModel, one token per step, greedy.
tokens/s: the steps after the first WARMUP, timed in rounds of --per-round steps, the
candidates in turn, so that a shared machine's load falls on all alike. Agreement with
bfloat16 over --tokens tokens: `same_prefix`, the tokens produced before the first
difference; `teacher_forced`, the share of positions whose argmax equals bfloat16's token
when both read bfloat16's own output.

Candidates: `bfloat16`, `float32`; `int8`, `int4` (services/engine/quant.py: torch's int8
kernel, the engine's int4 kernel on x86 CPUs); `int4-torch` (torch's int4 CPU kernel);
`dynamic-int8` (torch.ao quantize_dynamic, float32 activations); and, where the torchao package
imports, `torchao-int8`, `torchao-int4`, `torchao-int8-dyn`. `--compile NAMES` adds a
`NAME+compiled` row for each, with every decoder layer's MLP under torch.compile (fullgraph; a
candidate that does not compile gets a row with the error).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
from specserve.engine import models, quant
from specserve.engine.flat_model import FlatModel, Segment

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring."
WARMUP = 4


def load_plain(path: Path, dtype: str):
    return models.load_model(path, "cpu", dtype)


def load_torch_int4(path: Path):
    """int4 on torch's own CPU kernel rather than the engine's (SPECSERVE_INT4_KERNEL=torch)."""
    os.environ["SPECSERVE_INT4_KERNEL"] = "torch"
    try:
        return load_plain(path, "int4")
    finally:
        del os.environ["SPECSERVE_INT4_KERNEL"]


def load_dynamic_int8(path: Path):
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    model = models.load_model(path, "cpu", "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig})


def load_torchao(path: Path, kind: str):
    import torchao.quantization as q

    model = models.load_model(path, "cpu", "bfloat16")
    if kind == "int8":
        config = q.Int8WeightOnlyConfig()
    elif kind == "int8-dyn":
        config = q.Int8DynamicActivationInt8WeightConfig()
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=quant.INT4_GROUP)
    q.quantize_(model, config)
    return model


def loaders(path: Path) -> dict[str, Callable]:
    found = {
        "bfloat16": lambda: load_plain(path, "bfloat16"),
        "float32": lambda: load_plain(path, "float32"),
        "int8": lambda: load_plain(path, "int8"),
        "int4": lambda: load_plain(path, "int4"),
        "int4-torch": lambda: load_torch_int4(path),
        "dynamic-int8": lambda: load_dynamic_int8(path),
    }
    try:
        import torchao  # noqa: F401

        for kind in ("int8", "int4", "int8-dyn"):
            found[f"torchao-{kind}"] = lambda kind=kind: load_torchao(path, kind)
    except ImportError:
        pass
    return found


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def compile_mlps(hf_model) -> None:
    """Every decoder layer's MLP through one compiled function (the module is an input)."""
    torch._dynamo.config.recompile_limit = 64  # one graph per candidate and token count
    run = torch.compile(_mlp, fullgraph=True, dynamic=False)
    for layer in hf_model.model.layers:
        layer.mlp.forward = functools.partial(run, layer.mlp)


class Decoder:
    """One candidate's greedy decode, advanced a few steps at a time between the others'."""

    def __init__(self, name: str, hf, prompt: list[int], tokens: int, load_s: float):
        self.name, self.hf, self.load_s = name, hf, load_s
        self.model = FlatModel(hf)
        self.kv = self.model.new_kv()
        self.ids = [int(self.model.forward([Segment(self.kv, prompt)])[0][-1].argmax())]
        self.seconds, self.timed = 0.0, 0

    def step(self, count: int, timed: bool) -> None:
        started = time.perf_counter()
        for _ in range(count):
            logits = self.model.forward([Segment(self.kv, self.ids[-1:])])[0]
            self.ids.append(int(logits[-1].argmax()))
        if timed:
            self.seconds += time.perf_counter() - started
            self.timed += count


def teacher_forced(model: FlatModel, prompt: list[int], reference: list[int]) -> float:
    """Share of positions whose argmax equals the reference's token, reading the reference."""
    kv = model.new_kv()
    seg = Segment(kv, prompt + reference[:-1], logits_from=len(prompt) - 1)
    predicted = model.forward([seg])[0].argmax(dim=-1).tolist()
    return sum(p == r for p, r in zip(predicted, reference, strict=True)) / len(reference)


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def release_freed_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def start(name: str, load: Callable, prompt: list[int], tokens: int) -> Decoder | dict:
    """The candidate's decoder, past its prompt; or a row with the error it failed with."""
    started = time.perf_counter()
    hf = load()
    load_s = time.perf_counter() - started
    release_freed_memory()  # the float32 copies quantisation read from
    if name.endswith("+compiled"):
        compile_mlps(hf)
    try:
        return Decoder(name, hf, prompt, tokens, load_s)
    except Exception as e:  # a candidate that does not compile is a result, not a crash
        return {"candidate": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def run_rounds(decoders: list[Decoder], tokens: int, per_round: int) -> None:
    """WARMUP untimed steps each (compiles), then rounds of per_round steps, each candidate
    in turn, so that load on a shared machine falls on all of them alike."""
    for d in decoders:
        d.step(WARMUP, timed=False)
    left = tokens - 1 - WARMUP
    while left > 0:
        count = min(per_round, left)
        for d in decoders:
            d.step(count, timed=True)
        left -= count


def row_of(d: Decoder, prompt: list[int], reference: list[int] | None) -> dict:
    row = {
        "candidate": d.name,
        "tokens_per_s": round(d.timed / d.seconds, 2),
        "load_s": round(d.load_s, 1),
        "weights_mb": round(weight_bytes(d.hf) / 1e6),
    }
    if reference is not None and d.name != "bfloat16":
        row["same_prefix"] = same_prefix(d.ids, reference)
        row["teacher_forced"] = round(teacher_forced(d.model, prompt, reference), 3)
    return row | {"ids": d.ids}


def weight_bytes(model) -> int:
    """Bytes of the distinct tensors a model holds (a tied embedding counted once)."""
    tensors, seen = [], set()
    for value in model.state_dict().values():
        tensors.extend(value if isinstance(value, tuple) else [value])
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["target", "draft"], default="target")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--candidates", default="bfloat16,int8,int4,dynamic-int8")
    p.add_argument("--per-round", type=int, default=4, help="steps per candidate per round")
    p.add_argument("--compile", default="", help="candidates to add compiled rows for")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ref = ModelRef() if args.model == "target" else DrafterSettings().draft_model
    path, _ = models.resolve(ref, ServiceSettings.load(None).model_cache_dir)
    tok = models.load_tokenizer(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text).input_ids
    available = loaders(path)
    names = [n for n in args.candidates.split(",") if n]
    names += [n for n in args.compile.split(",") if n and n not in names]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(f"unknown or unavailable candidates {unknown}; have {list(available)}")
    runs = [(n, available[n]) for n in names]
    runs += [(f"{n}+compiled", available[n]) for n in args.compile.split(",") if n]
    started = [start(name, load, prompt, args.tokens) for name, load in runs]
    decoders = [d for d in started if isinstance(d, Decoder)]
    run_rounds(decoders, args.tokens, args.per_round)
    reference = next((d.ids for d in decoders if d.name == "bfloat16"), None)
    rows = [row_of(d, prompt, reference) if isinstance(d, Decoder) else d for d in started]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "ids"}), flush=True)
    if args.out:
        result = {
            "command": "python -m benchmarks.quant_decode " + " ".join(sys.argv[1:]),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "model": ref.label,
            "threads": args.threads,
            "tokens": args.tokens,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
