"""How many sequences run at once in a fixed KV memory: blocks with preemption, against
reserving each request's worst case.

    python -m benchmarks.kv_concurrency [--tiny] [--requests 48] [--kv-tokens 16384]
        [--block-size 16] [--max-seq-len 4096]

The verifier's real Engine, Admission and block pool (in this process, against a private
redis-server), with SmolLM2-135M as the target (`specserve models fetch
smollm2-135m-instruct@0.1.2` first) or, with --tiny, a tiny random Qwen2 (the steps and the
concurrency are the same: they follow from the rule and the workload, not the weights), float32
by default, plain decoding. A seeded mixed workload: prompts of 100-2,000 tokens, outputs of
50-2,000, and max_tokens as generous as the context allows (max_seq_len less the prompt), as
clients set it. A request ends at its output length, as if it had met its EOS there: the
admission rule never knows when that is.
Requests arrive all at once and are admitted first in, first out, whenever they fit.

Two admission rules over the same pool, workload and engine:
- blocks: this verifier's rule (a prompt's blocks; a sequence takes more as it grows; the step
  preempts by recompute when the pool runs dry);
- worst case: the rule before blocks, emulated by the harness: a request is admitted only when
  the worst cases (capacity.kv_need) of all running ones and its own fit the pool.
Reports per rule the number of sequences holding KV per step (peak; mean over the steps where
requests were waiting for room, which is how many fit; mean over all steps), preemptions,
failed requests, steps and wall time.
Writes <out>/kv_concurrency_<max_seq_len>_<block_size>[_tiny].json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.common.capacity import kv_need
from specserve.common.settings import ModelRef, ServiceSettings
from specserve.engine import models
from specserve.engine.flat_model import FlatModel
from specserve.speculation.sampling import SamplingParams
from specserve.speculation.tree import DraftTree
from specserve.store import RequestStore
from specserve.tools.local_cluster import free_port
from specserve.verifier.admission import Admission, Refused
from specserve.verifier.engine import Engine, engine_settings
from specserve.verifier.runner import ModelRunner
from specserve.verifier.sequence import Sequence
from specserve.verifier.writes import Owner

VID = "bench-verifier"


@dataclass
class Request:
    rid: str
    prompt: list[int]
    output: int  # tokens it generates before its (emulated) EOS
    max_tokens: int  # what the client asked for


def workload(count: int, seed: int, max_seq_len: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(1000, 20000) for _ in range(rng.randint(100, 2000))]
        output = min(rng.randint(50, 2000), max_seq_len - len(prompt) - 1)
        out.append(Request(f"r{i}", prompt, output, max_seq_len - len(prompt)))
    return out


class NoDrafts:
    """Plain decoding: the step's trees are empty."""

    def propose(self, seqs, other_tokens=0, first_token=False):
        return [DraftTree() for _ in seqs]

    def observe_step(self, *args) -> None:
        pass

    def observe_acceptance(self, *args) -> None:
        pass

    def forget(self, seq) -> None:
        pass


def sequence(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    """A greedy interactive sequence as VerifierService.Admit makes one, admitted now."""
    return Sequence(
        request_id=rid,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        params=SamplingParams(),
        stop=[],
        queue="interactive",
        entry_id="0-0",
        created_ms=0,
        admitted_ms=int(time.time() * 1000),
    )


def simulate(flat: FlatModel, store: RequestStore, requests: list[Request], rule: str, args):
    pool = flat.use_pool(args.kv_tokens, args.block_size, fixed=True)
    admission = Admission(
        pool, args.batch_size, 0, watermark_blocks=int(0.01 * pool.blocks), prefix_cache=True
    )
    engine = Engine(
        ModelRunner(flat),
        NoDrafts(),
        store,
        admission,
        **engine_settings(
            max_seq_len=args.max_seq_len,
            max_prefill_tokens=512,
            async_step_writes=False,  # (a sequence leaves, and frees its blocks, at its step)
            max_unread_tokens=0,  # (no client reads here: nothing pauses)
        ),
        owner=Owner(verifier_id=VID),
        eos_ids=set(),
        decode=lambda ids: "",
    )
    waiting = deque(requests)
    worst: dict[str, int] = {}
    seqs: list[Sequence] = []
    holding, queued, started = [], [], time.perf_counter()
    while waiting or engine.running:
        while waiting:
            req = waiting[0]
            need = kv_need(len(req.prompt), req.max_tokens, args.max_seq_len)
            live = sum(worst[rid] for rid in engine.running)
            if rule == "worst case" and live + need > pool.tokens:
                break
            rid = f"{rule[0]}-{req.rid}"
            try:
                grant = admission.admit(rid, "interactive", req.prompt)
            except Refused:
                break
            waiting.popleft()
            worst[rid] = need
            spec = {"prompt_ids": req.prompt, "max_tokens": req.max_tokens}
            store.create(rid, spec, "interactive", 10_000)
            store.claim(rid, VID, int(time.time() * 1000))
            seq = sequence(rid, req.prompt, req.output)  # its EOS: admission saw max_tokens
            engine.admit(seq, grant)
            engine._take_new(block=False)
            seqs.append(seq)
        engine.step()
        holding.append(sum(not s.preempted for s in engine.running.values()))
        if waiting:  # the pool is the limit: a request waits for room
            queued.append(holding[-1])
    failed = [s.request_id for s in seqs if s.finish_reason != "FINISH_REASON_LENGTH"]
    return {
        "rule": rule,
        "peak_concurrent": max(holding),
        "mean_concurrent_while_requests_wait": round(statistics.mean(queued or [0]), 2),
        "mean_concurrent": round(statistics.mean(holding), 2),
        "preemptions": sum(s.preemptions for s in seqs),
        "failed_requests": len(failed),
        "generated_tokens": sum(len(s.output_ids) for s in seqs),
        "steps": len(holding),
        "wall_s": round(time.perf_counter() - started, 1),
        "pool_blocks_free_at_end": pool.available == pool.blocks,
    }


def smollm2(args):
    path, _ = models.resolve(ModelRef(name="smollm2-135m-instruct", version="0.1.2"), args.models)
    return models.load_model(path, "cpu", args.dtype)


def tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=20000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
    )
    return Qwen2ForCausalLM(config).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=4096, help="the verifier's max_seq_len")
    p.add_argument("--models", default=ServiceSettings().model_cache_dir, help="model cache")
    p.add_argument("--rules", default="blocks,worst case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random Qwen2 (2 layers, hidden 64) instead of SmolLM2: the same steps and "
        "concurrency (they depend on the KV rule and the workload, not on the weights), in "
        "minutes instead of hours on a 2-core CPU",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flat = FlatModel(tiny_qwen() if args.tiny else smollm2(args))
    requests = workload(args.requests, args.seed, args.max_seq_len)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--save", "", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )
        try:
            store = RequestStore.from_url(f"redis://127.0.0.1:{port}/0")
            store.wait_reachable()
            store.ensure_queues()
            for rule in args.rules.split(","):
                results.append(simulate(flat, store, requests, rule, args))
                print(json.dumps(results[-1]), flush=True)
        finally:
            redis.terminate()
    by_rule = {r["rule"]: r for r in results}
    report = {
        "command": f"python -m benchmarks.kv_concurrency --requests {args.requests} "
        f"--kv-tokens {args.kv_tokens} --block-size {args.block_size} --seed {args.seed} "
        f"--max-seq-len {args.max_seq_len} --dtype {args.dtype}" + " --tiny" * args.tiny,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": f"{'a tiny random Qwen2' if args.tiny else 'SmolLM2-135M'} "
        f"{args.dtype} target, cpu, plain decoding, "
        "in-process engine; "
        f"{args.kv_tokens}-token pool, {args.block_size}-token blocks; prompts 100-2000, "
        f"outputs 50-2000, max_tokens = max_seq_len ({args.max_seq_len}) - prompt",
        "results": results,
    }
    if {"blocks", "worst case"} <= by_rule.keys():
        key = "mean_concurrent_while_requests_wait"
        report["concurrency_ratio"] = round(by_rule["blocks"][key] / by_rule["worst case"][key], 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"kv_concurrency_{args.max_seq_len}_{args.block_size}{'_tiny' * args.tiny}.json"
    (out / name).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))


if __name__ == "__main__":
    main()
