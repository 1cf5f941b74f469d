"""xgrammar vs llguidance for JSON-schema constrained decoding, on this CPU, with the default
target's tokenizer (Qwen2.5-Coder: 151,936 ids).

    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/xgr python -m benchmarks.grammar_engines [--reps 5]

xgrammar stays out of the venv (its wheel pulls in triton): `pip install --no-deps --target
/tmp/xgr xgrammar apache-tvm-ffi`. Per engine: the tokenizer-info build (once per tokenizer);
per schema the compile (median of --reps, a fresh cache-less compiler each time) and the first
mask after it; the full next-token bitmask, into a preallocated buffer, before each token of a
valid instance tokenized with the model's tokenizer (a cold pass, then --passes timed ones:
median and p99), asserting each token is allowed and accepted, the instance completes, EOS then
passes and an invalid first token is masked out and refused; accepting k=4 tokens and rolling
them back (per token); the forced (jump-forward) prefix. Then a bad $ref, an unsatisfiable and two
hostile schemas, each in a forked child with a timeout. Writes results/grammar_engines.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoTokenizer

from specserve.common.settings import ServiceSettings
from specserve.engine.models import DEFAULT_MODELS, model_dir

K = 4  # rollback depth: a speculative draft of 4
XGR_THREADS = 8  # GrammarCompiler's default max_threads
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito"]


def obj(required, **props):
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


def nested(depth):
    return {"type": "integer"} if depth == 0 else obj(["a"], a=nested(depth - 1))


def nested_instance(depth):
    return 1 if depth == 0 else {"a": nested_instance(depth - 1)}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
TOOL = obj(["name", "arguments"], name={"const": "search_code"}, arguments=obj(
    ["query", "repo", "max_results", "case_sensitive", "filters", "sort", "page"],
    query=STR, repo={"type": "string", "pattern": "^[a-z0-9-]+/[a-z0-9-]+$"},
    max_results={"type": "integer", "minimum": 1, "maximum": 100}, case_sensitive=BOOL,
    filters=obj(["language", "paths"], language={"enum": ["python", "go", "rust", "c"]},
                paths={"type": "array", "items": STR}, min_stars={"type": ["integer", "null"]}),
    sort=obj(["by", "desc"], by={"enum": ["score", "date"]}, desc=BOOL),
    page=INT, timeout_s={"type": "number"}, user=STR))  # fmt: skip
SCHEMAS = {  # name: (schema, a valid instance)
    "any_object": ({"type": "object"}, {"id": 7, "tags": ["a", "b"], "m": {"ok": True, "x": None}}),
    "small_strict": (
        obj(["name", "age", "city", "scores"], name=STR, age=INT, city={"enum": CITIES},
            scores={"type": "array", "items": {"type": "number"}}),
        {"name": "Ada Lovelace", "age": 36, "city": "Oslo", "scores": [1.5, -2, 3e2]}),
    "tool_call": (TOOL, {"name": "search_code", "arguments": {
        "query": "def rollback(self, num_tokens)", "repo": "mlc-ai/xgrammar", "max_results": 20,
        "case_sensitive": False, "filters": {"language": "python", "paths": ["python/", "tests/"],
        "min_stars": None}, "sort": {"by": "score", "desc": True}, "page": 1, "timeout_s": 2.5}}),
    "enum_1000": (obj(["sku"], sku={"enum": [f"sku-{i:04d}-{CITIES[i % 5]}" for i in range(1000)]}),
                  {"sku": "sku-0734-Quito"}),
}  # fmt: skip
BAD = {  # name: (schema, a valid instance or None)
    "bad_ref": ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, None),
    "unsatisfiable": ({"type": "string", "minLength": 5, "maxLength": 2}, None),
    "enum_10000": ({"enum": [f"v{i:05d}" for i in range(10000)]}, "v07321"),
    "nested_50": (nested(50), nested_instance(50)),
}


def xgrammar_engine(tok, vocab):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)  # the model's vocab size
    bitmask = xgr.allocate_token_bitmask(1, vocab)  # int32 [1, ceil(vocab / 32)], CPU

    def compile_(schema, compact=False):  # default: any whitespace between tokens
        c = xgr.GrammarCompiler(info, max_threads=XGR_THREADS, cache_enabled=False)
        ws = {"any_whitespace": False, "separators": (",", ":")} if compact else {}
        t0 = time.perf_counter()
        compiled = c.compile_json_schema(json.dumps(schema), **ws)
        return compiled, time.perf_counter() - t0

    return SimpleNamespace(
        name="xgrammar", version=version("xgrammar"), bitmask=bitmask, compile=compile_,
        matcher=xgr.GrammarMatcher,
        fill=lambda m: m.fill_next_token_bitmask(bitmask, 0),
        accept=lambda m, t: m.accept_token(t),
        rollback=lambda m, k: m.rollback(k),
        complete=lambda m: m.is_completed(),
        finish=lambda m, eos: m.accept_token(eos) and m.is_terminated(),
        forced=lambda m: m.find_jump_forward_string(),
    )  # fmt: skip


def llguidance_engine(tok, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile_(schema, compact=False):  # the compiled form is a matcher; its ctor never raises
        ws = {"whitespace_flexible": False} if compact else None
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=ws)
        m = llguidance.LLMatcher(lltok, grammar)
        dt = time.perf_counter() - t0
        if m.is_error():
            raise ValueError(f"LLMatcher.is_error(): {m.get_error()}")
        return m, dt

    def rollback(m, k):
        assert m.rollback(k), m.get_error()

    return SimpleNamespace(
        name="llguidance", version=llguidance.get_version(), bitmask=bitmask, compile=compile_,
        matcher=lambda compiled: compiled.deep_copy(),
        fill=lambda m: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0),
        accept=lambda m, t: m.consume_token(t),
        rollback=rollback,
        complete=lambda m: m.is_accepting(),
        finish=lambda m, eos: m.consume_token(eos) and m.is_stopped(),
        forced=lambda m: m.compute_ff_bytes().decode("utf-8", "replace"),
    )  # fmt: skip


def allows(eng, t):
    return bool((int(eng.bitmask[0, t // 32]) >> (t % 32)) & 1)


def drive(eng, m, ids, tok, times):  # mask before each token, then accept it
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        eng.fill(m)
        times.append(time.perf_counter() - t0)
        assert allows(eng, t), f"{eng.name}: token {i} {tok.decode([t])!r} masked out"
        assert eng.accept(m, t), f"{eng.name}: token {i} {tok.decode([t])!r} refused"
    return eng.complete(m)


def bench(eng, schema, instance, tok, reps, passes):
    ids, eos = tok.encode(json.dumps(instance), add_special_tokens=False), tok.eos_token_id
    compile_s, first_s = [], []
    for _ in range(reps):
        compiled, dt = eng.compile(schema)
        m = eng.matcher(compiled)
        compile_s.append(dt)
        t0 = time.perf_counter()
        eng.fill(m)
        first_s.append(time.perf_counter() - t0)
    bad = tok.encode("[", add_special_tokens=False)[0]  # every schema here wants an object
    assert not allows(eng, bad) and not eng.accept(eng.matcher(compiled), bad), "bad token passed"
    cold, mask_s = [], []
    for p in range(passes + 1):  # pass 0 is cold and warms the matcher
        m = eng.matcher(compiled)
        assert drive(eng, m, ids, tok, mask_s if p else cold), f"{eng.name}: instance incomplete"
        eng.fill(m)
        assert allows(eng, eos) and eng.finish(m, eos), f"{eng.name}: EOS refused at the end"
    accept_s, rollback_s, m = [], [], eng.matcher(compiled)
    for i in range(len(ids) - K):  # at each position go K tokens down the path, then back
        t0 = time.perf_counter()
        for t in ids[i : i + K]:
            assert eng.accept(m, t)
        t1 = time.perf_counter()
        eng.rollback(m, K)
        rollback_s.append((time.perf_counter() - t1) / K)
        accept_s.append((t1 - t0) / K)
        assert eng.accept(m, ids[i])
    med = statistics.median
    return {"tokens": len(ids), "compile_ms": med(compile_s) * 1e3,
            "compile_ms_all": [x * 1e3 for x in compile_s], "first_mask_ms": med(first_s) * 1e3,
            "cold_pass_mask_ms": sum(cold) * 1e3, "mask_us_median": med(mask_s) * 1e6,
            "mask_us_p99": float(np.percentile(mask_s, 99)) * 1e6, "mask_us_max": max(mask_s) * 1e6,
            "mask_samples": len(mask_s), "accept_us_per_token": med(accept_s) * 1e6,
            "rollback_us_per_token": med(rollback_s) * 1e6,
            "forced_at_start": eng.forced(eng.matcher(compiled)),  # any whitespace: just "{"
            "forced_at_start_compact": eng.forced(eng.matcher(eng.compile(schema, True)[0])),
    }  # fmt: skip


def probe(eng, schema, instance, tok, conn):  # in a forked child, so a runaway can be killed
    try:
        compiled, dt = eng.compile(schema)
        out = {"compiled": True, "compile_ms": dt * 1e3}
        if instance is not None:  # a cold pass along a valid instance: lazily built state shows
            masks, ids = [], tok.encode(json.dumps(instance), add_special_tokens=False)
            out["valid_instance_complete"] = drive(eng, eng.matcher(compiled), ids, tok, masks)
            out.update(tokens=len(ids), cold_pass_mask_ms=sum(masks) * 1e3,
                       max_mask_us=max(masks) * 1e6)  # fmt: skip
        conn.send(out)
    except BaseException as e:  # noqa: BLE001 - how the engine refuses is what is recorded
        conn.send({"compiled": False, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})


def guarded(eng, schema, instance, tok, timeout):
    ctx, t0 = mp.get_context("fork"), time.perf_counter()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=probe, args=(eng, schema, instance, tok, child))
    proc.start()
    child.close()  # so that a crashed child reads as EOF, not as a timeout
    try:
        out = parent.recv() if parent.poll(timeout) else {"compiled": None, "error": "timeout"}
    except EOFError:
        out = {"compiled": None, "error": "child died without answering"}
    if proc.is_alive():
        proc.kill()
    proc.join()
    return {**out, "wall_s": time.perf_counter() - t0, "exitcode": proc.exitcode}


def main():
    model, ver = DEFAULT_MODELS[0]
    cache = ServiceSettings.model_fields["model_cache_dir"].default
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=str(model_dir(cache, model, ver)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0, help="per bad/hostile schema")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/grammar_engines.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # neither engine uses torch's pool; masks are computed in-thread
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = json.loads((Path(args.tokenizer) / "config.json").read_text())["vocab_size"]
    env = [f"{k}={os.environ[k]}" for k in ("HF_HUB_OFFLINE", "PYTHONPATH") if k in os.environ]
    res = {"command": " ".join(env + ["python -m benchmarks.grammar_engines"] + sys.argv[1:]),
           "tokenizer": args.tokenizer, "tokenizer_len": len(tok), "model_vocab_size": vocab,
           "eos_token_id": tok.eos_token_id, "reps": args.reps, "passes": args.passes,
           "rollback_k": K, "threads": {"torch": torch.get_num_threads(), "cpus": os.cpu_count(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "xgrammar_compiler": XGR_THREADS,
           "note": "masks are one call on the calling thread; llguidance.LLExecutor unused"},
           "engines": {}}  # fmt: skip
    engines = []
    for name, make in (("xgrammar", xgrammar_engine), ("llguidance", llguidance_engine)):
        try:
            t0 = time.perf_counter()
            engines.append(make(tok, vocab))
            dt = time.perf_counter() - t0
            res["engines"][name] = {"version": engines[-1].version, "tokenizer_info_s": dt}
        except ImportError as e:
            print(f"{name}: not importable ({e}); skipped", file=sys.stderr)
            res["engines"][name] = {"skipped": str(e)}
    for eng in engines:
        r = res["engines"][eng.name]
        print(f"{eng.name} {eng.version}: tokenizer info {r['tokenizer_info_s']:.2f} s", flush=True)
        m = eng.matcher(eng.compile({"type": "string"})[0])
        drive(eng, m, tok.encode('"ab', add_special_tokens=False), tok, [])
        eng.fill(m)  # which odd ids does a mask inside a JSON string let through?
        odd = [tok.eos_token_id, 151643, 151644, 151665, vocab - 1]
        r["inside_string_allows"] = {tok.convert_ids_to_tokens(t): allows(eng, t) for t in odd}
        r["schemas"] = {s: bench(eng, *SCHEMAS[s], tok, args.reps, args.passes) for s in SCHEMAS}
        r["bad_schemas"] = {b: guarded(eng, *BAD[b], tok, args.timeout) for b in BAD}
    cols = ("schema", "engine", "tokens", "compile ms", "1st mask ms", "cold ms", "mask p50 us",
            "p99 us", "accept us", "rollback us", "  forced prefix (compact JSON)")  # fmt: skip
    print("\n" + "".join(f"{c:<13}" if i < 2 else f"{c:>12}" for i, c in enumerate(cols)))
    for s in SCHEMAS:
        for eng in engines:
            b = res["engines"][eng.name]["schemas"][s]
            print(f"{s:<13}{eng.name:<13}{b['tokens']:>12}{b['compile_ms']:>12.2f}"
                  f"{b['first_mask_ms']:>12.3f}{b['cold_pass_mask_ms']:>12.2f}"
                  f"{b['mask_us_median']:>12.1f}{b['mask_us_p99']:>12.1f}"
                  f"{b['accept_us_per_token']:>12.2f}{b['rollback_us_per_token']:>12.2f}"
                  f"  {b['forced_at_start_compact'][:28]!r}")  # fmt: skip
    print("\nbad / hostile schemas")
    for b in BAD:
        for eng in engines:
            o = res["engines"][eng.name]["bad_schemas"][b]
            if not o["compiled"]:
                print(f"  {b:<14}{eng.name:<11}{o['error'][:120]}")
                continue
            print(f"  {b:<14}{eng.name:<11}compiles in {o['compile_ms']:.1f} ms; valid instance "
                  f"({o['tokens']} tokens): masks {o['cold_pass_mask_ms']:.2f} ms cold, "
                  f"max {o['max_mask_us']:.0f} us")  # fmt: skip
    for eng in engines:
        odd = res["engines"][eng.name]["inside_string_allows"]
        print(f"{eng.name}: inside a JSON string the mask allows {odd}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
