"""What one verifier step and one drafter proposal ask of the host, counted rather than timed.

    python -m benchmarks.step_counts [--batches 1,8,64] [--nodes 8] [--context 256]
    python -m benchmarks.step_counts --save-proxy DIR    (the proxy as a model directory)

The 36M proxy of the default target (its layout: 28 layers, 12 query and 2 KV heads, its
vocabulary, tied embeddings; hidden size 192, intermediate 256, random weights), float32 on
the CPU, over a private Redis. For each batch size, greedy and sampled: the sequences'
prompts (--context tokens) prefilled and one step taken, then one Engine.step with an
--nodes-node draft tree per sequence, counted by `StepCounter`:
- syncs: tensor data read into Python (`item`, `tolist`, `numpy`, `bool`/`int`/`float`/index
  of a tensor, `cpu`): on a GPU each waits for the device. Counted on the CPU as the same
  calls, so a read of a tensor that would stay on the host counts too (an upper bound);
- host copies: tensors made from Python data onto a device (`torch.tensor`, `as_tensor` with
  `device=`) and blocking `.to(device)` calls: each a host-to-device copy on a GPU (a
  tensor made on the host and kept there is not one);
- ops: ATen ops dispatched, and of them those that allocate (every op but views and in-place
  ones);
- step_ms, host_ms: medians of five more steps' wall time and of their part outside the
  model's pass (plan, layout, selection, commit, emit; `host_time`).
The same counts for one draft-model proposal (the proxy as the draft model, `count_draft`):
trees and chains of depth 4, greedy and sampled.
Writes <out>/step_counts.json (merged under --label).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
FROM_HOST = {torch.tensor, torch.as_tensor}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}


class _Functions(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.counts["syncs"] += 1
            self.counts[f"sync:{func.__name__}"] += 1
        elif func in FROM_HOST and kwargs.get("device") is not None:
            self.counts["host_copies"] += 1
            self.counts[f"host:{func.__name__}"] += 1
        elif func in MOVES and not kwargs.get("non_blocking", False) and _moves(func, args, kwargs):
            self.counts["host_copies"] += 1
            self.counts["host:to"] += 1
        return func(*args, **kwargs)


def _moves(func, args, kwargs) -> bool:
    """Whether a `.to` call names a device, or it is `.cuda` (a copy across devices where it
    is not the one the tensor is on; on the CPU every such call is counted)."""
    if func is torch.Tensor.cuda:
        return True
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (torch.device, str)) for t in targets)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["ops"] += 1
        schema = func._schema
        aliases = any(r.alias_info is not None for r in schema.returns)
        if not aliases and not schema.is_mutable:
            self.counts["allocating_ops"] += 1
        return func(*args, **(kwargs or {}))


class StepCounter:
    """Counts, while entered, what the code run asks of the host (see the module's text);
    `counts` holds the totals and, per kind, which call made them."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._modes = (_Functions(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> StepCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def summary(self) -> dict[str, int]:
        keys = ("syncs", "host_copies", "ops", "allocating_ops")
        return {k: self.counts[k] for k in keys} | {
            k: v for k, v in sorted(self.counts.items()) if ":" in k
        }


# --- the engine under count -------------------------------------------------------------
def proxy_model(vocab_size: int):
    """The default target's layout at almost no compute (random weights, float32)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_proxy(path: Path) -> None:
    """The proxy model and the default target's tokenizer, saved as a model directory."""
    from specserve.common.settings import VerifierSettings
    from specserve.engine import models

    settings = VerifierSettings()
    target, _ = models.resolve(settings.model, settings.model_cache_dir)
    proxy_model(151_936).save_pretrained(path)
    models.load_tokenizer(target).save_pretrained(path)
    print(f"proxy model at {path}")


class FixedTrees:
    """A speculator whose every decoding sequence gets the same shape of model-free tree:
    a chain of half the nodes, and the rest as siblings along it."""

    def __init__(self, nodes: int, vocab_size: int):
        self.nodes, self.vocab_size = nodes, vocab_size

    def propose(self, seqs, other_tokens=0, first_token=False):
        from specserve.speculation.tree import DraftTree

        trees = []
        for i, seq in enumerate(seqs):
            tree = DraftTree(model_free=True)
            if not seq.prefilling:
                chain = self.nodes - self.nodes // 2
                parent = -1
                for depth in range(chain):
                    parent = tree.add((7 * i + 13 * depth) % self.vocab_size, parent)
                for k in range(self.nodes - chain):
                    tree.add((11 * i + 17 * k + 1) % self.vocab_size, k - 1 if k else -1)
            trees.append(tree)
        return trees

    def observe_step(self, *args) -> None:
        pass

    def observe_acceptance(self, seq, tree, accepted: int, tested: int) -> None:
        pass

    def forget(self, seq) -> None:
        pass


def count_step(
    model, redis_url: str, batch: int, nodes: int, context: int, sampled: bool, flat=None
):
    from specserve.engine.flat_model import FlatModel
    from specserve.speculation.sampling import SamplingParams
    from specserve.store import RequestStore
    from specserve.verifier.admission import Admission
    from specserve.verifier.engine import Engine, engine_settings
    from specserve.verifier.runner import ModelRunner
    from specserve.verifier.sequence import Sequence
    from specserve.verifier.writes import Owner

    store = RequestStore.from_url(redis_url)
    store.r.flushdb()
    store.ensure_queues()
    flat = flat or FlatModel(model)
    vocab = model.config.vocab_size
    pool = flat.use_pool(batch * (context + 4 * nodes + 64), 16, fixed=True)
    engine = Engine(
        ModelRunner(flat),
        FixedTrees(nodes, vocab),
        store,
        Admission(pool, batch_size=batch, interactive_reserved_slots=0),
        **engine_settings(
            max_seq_len=context + 1024,
            max_prefill_tokens=4096,
            async_step_writes=True,  # (as the verifier runs by default: a step's write travels)
            max_unread_tokens=0,  # (no client reads here: nothing pauses)
        ),
        owner=Owner(verifier_id="counted"),
        eos_ids=set(),
        decode=lambda ids: "",
    )
    params = SamplingParams(temperature=0.8, seed=1) if sampled else SamplingParams()
    for i in range(batch):
        rid = f"r{i}"
        prompt = [(31 * i + 7 * t + 3) % vocab for t in range(context)]
        store.create(rid, {"prompt_ids": prompt, "max_tokens": 512}, "interactive", 10_000)
        assert store.claim(rid, "counted", int(time.time() * 1000)) == 1
        seq = Sequence(
            request_id=rid,
            prompt_ids=prompt,
            max_tokens=512,
            params=params,
            stop=[],
            queue="interactive",
            entry_id="0-0",
            created_ms=0,
            admitted_ms=0,
        )
        engine.admit(seq, engine.admission.admit(rid, seq.queue, prompt))
    engine._take_new(block=False)
    while any(s.prefilling for s in engine.running.values()):
        engine.step()
    engine.step()  # (a first decoding step: what runs once is not counted)
    assert len(engine.running) == batch, "a sequence ended before the counted step"
    with StepCounter() as counter:
        engine.step()
    return counter.summary() | host_time(engine, flat)


def count_draft(model, batch: int, shape, temperature: float, context: int = 64) -> dict:
    """One draft-model proposal of 16-node trees for `batch` sequences, counted (each
    sequence's prompt drafted once before, so its KV is there, and two tokens accepted
    since); with the fewest nodes a tree got."""
    from specserve.engine.flat_model import FlatModel
    from specserve.speculation.draft_model import DraftModelProposer
    from specserve.speculation.proposer import DraftJob

    proposer = DraftModelProposer(FlatModel(model), shape, sample_support=8)
    vocab = model.config.vocab_size
    jobs = [
        DraftJob(
            f"s{i}",
            [(31 * i + 7 * t + 3) % vocab for t in range(context)],
            budget=16,
            temperature=temperature,
            seed=i,
        )
        for i in range(batch)
    ]
    proposer.propose(jobs)
    for job in jobs:
        job.tokens = job.tokens + [7, 8]
    with StepCounter() as counter:
        trees = proposer.propose(jobs)
    return counter.summary() | {"least_nodes": min(map(len, trees))}


def host_time(engine, flat, steps: int = 5) -> dict[str, float]:
    """Median over `steps` steps of a step's wall time and of its part outside the model's
    pass (`FlatModel.run`: on the CPU the compute itself): plan, layout, selection, commit
    and emit, with selection's device work included (so an upper bound of the host's part)."""
    inside = [0.0]
    passes = [o for o in (flat, flat.graph) if o is not None]  # (eager and graph steps)

    def timed(run):
        def timed_run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - started

        return timed_run

    for o in passes:
        o.run = timed(o.run)
    walls, hosts = [], []
    try:
        for _ in range(steps):
            inside[0] = 0.0
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
            hosts.append(walls[-1] - inside[0])
    finally:
        for o in passes:
            del o.run
    return {
        "step_ms": round(1000 * statistics.median(walls), 2),
        "host_ms": round(1000 * statistics.median(hosts), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--nodes", type=int, default=8, help="draft tree nodes per sequence")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--label", default="main", help="the results' key (e.g. before, after)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="the verifier's forward compiled (verifier.compile: true): its steps as one graph",
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--save-proxy",
        metavar="DIR",
        help="only write the proxy model (with the default target's tokenizer) to DIR, for "
        "`python -m benchmarks.engine --parts tiny,batch --dtype float32 --target DIR --tiny DIR`",
    )
    args = p.parse_args()
    if args.save_proxy:
        save_proxy(Path(args.save_proxy))
        return
    from specserve.tools.local_cluster import LocalCluster

    torch.set_num_threads(2)
    model = proxy_model(151_936)
    flat = None
    if args.compile:
        from specserve.engine.flat_model import FlatModel

        flat, _ = FlatModel.prepare(model, compile=True, key="--compile")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalCluster({}, Path(tmp))
        try:
            url = redis.start_redis()
            for batch in map(int, args.batches.split(",")):
                for sampled in (False, True):
                    counts = count_step(model, url, batch, args.nodes, args.context, sampled, flat)
                    row = {"batch": batch, "sampled": sampled, **counts}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            redis.kill_redis()
    from specserve.speculation.proposer import TreeShape

    drafts = []
    shapes = {"tree": TreeShape(4, 2, 4), "chain": TreeShape(4, 1, 1)}
    for batch in map(int, args.batches.split(",")):
        for name, temperature in (("tree", 0.0), ("tree", 0.8), ("chain", 0.0), ("chain", 0.8)):
            counts = count_draft(model, batch, shapes[name], temperature)
            row = {"drafter": name, "batch": batch, "sampled": temperature > 0, **counts}
            print(json.dumps(row), flush=True)
            drafts.append(row)
    path = Path(args.out) / "step_counts.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[args.label] = {
        "command": f"python -m benchmarks.step_counts --batches {args.batches} --nodes "
        f"{args.nodes} --context {args.context} --label {args.label}"
        + (" --compile" if args.compile else ""),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": "36M proxy of the default target (28 layers, 12/2 heads, hidden "
        f"192), float32, CPU, {'compiled (one graph a step)' if args.compile else 'eager'}; "
        f"{args.nodes}-node model-free trees, {args.context}-token "
        "prompts; one Engine.step after prefill and one decoding step; Redis writes asynchronous",
        "rows": rows,
        "drafter": "the same model as a draft model: one proposal of 16-node trees, depth 4 "
        "(tree: branching 2, width 4; chain: branching 1), 64-token prompts",
        "drafter_rows": drafts,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
