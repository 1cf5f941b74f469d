"""Mean accepted tokens per step of each proposer on the benchmark workloads (Spec-Bench, code
edits, agentic calls), replayed against the target's own greedy output: cheap, and the same
on any hardware.

    python -m benchmarks.acceptance [--per-category 2] [--tokens 128] [--dtype auto]
                                    [--workload spec_bench,code_edit,agentic]
                                    [--proposers suffix,ngram,prompt_lookup,chain,tree,hybrid]
                                    [--profile VERIFIER_LOG] [--out benchmarks/results]

The workloads (benchmarks/workloads.py; default Spec-Bench's 13 categories, the standard
library's code edits, 3 categories, and the agentic tool calls): the first --per-category of
each category, their first turn (and system message) as a chat with the default target's
template.
The target's greedy output (--tokens tokens, or to its end) is generated once per question
through the engine and cached by the served version (weights, dtype, device) under
<model cache>/bench/acceptance/. Each proposer then replays every output step by step as the
verifier would check it: at position i it is asked for a tree after prompt + output[:i]; the
longest path of the tree that the output follows is accepted, plus the target's own next
token; the next step starts after them. Reported per category: tokens per step (accepted +
1, the figure papers call tau), its mean over categories, and drafted nodes per step. Trees
are as large as the default config allows (`verification_tree_size` 6 for the draft model,
`deep_tree_size` 64 for model-free trees), so this measures what proposers could get
accepted, not what the adaptive policy chooses to spend.

Proposers: `suffix` (ours: the request's own history and its tenant's earlier outputs, as
the default config), `arctic` (Arctic Inference's SuffixDecodingCache, built from its sdist
by benchmarks/arctic.py: the request's prompt and every earlier response, its defaults),
`ngram` (ours, 10 deep), `prompt_lookup` (Hugging Face's prompt lookup rule, written here:
the last 1-2 tokens' latest earlier occurrence, the 10 tokens after it),
`chain` and `tree` (the draft model: a greedy chain of 6, a tree of depth 6 branching 2, width
4, 16 nodes), `hybrid` (the default config: suffix tree or the draft model's chain, per step).
Every proposer takes config/specserve.yaml's drafter settings otherwise.
Questions are replayed in file order as one tenant, so the suffix tree learns from earlier
answers as it would in the service.

For a proposer that scores its nodes (suffix, hybrid), `score_bins` holds, per bin of the
node score, how many nodes its trees had and the share whose path the output followed: the
verifier's prior for its score calibration (policy.SCORE_PRIOR) is that table.

With --profile (a verifier's log, whose "verify profile measured" line holds the ms of a
forward pass by its tokens, or a JSON file of such a map), each category also gets its
`perfect_cut_speedup`: plain decoding's time (a one-token pass a token) over the time of the
same steps had each tree been cut to exactly its accepted path, both priced by that profile
(interpolated between its counts). It is what the proposer's trees could give on that machine
if the policy knew beforehand what the target keeps; drafter time and per-step overheads are
not counted, so for a draft model it overstates.
Writes <out>/acceptance.json and <out>/acceptance.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import yaml

from . import workloads

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config/specserve.yaml"
PROPOSERS = ("suffix", "arctic", "ngram", "prompt_lookup", "chain", "tree", "hybrid")
WORKLOAD = "spec_bench,code_edit,agentic"
MODEL_BUDGET, DEEP_BUDGET = 6, 64  # config/specserve.yaml's tree sizes


# --- the target's outputs -----------------------------------------------------------------
def target_outputs(rows: list[dict], tokens: int, dtype: str, device: str) -> tuple[list, str]:
    """(prompt ids, greedy output ids) per question, and the served version they are of."""
    from specserve.common.settings import VerifierSettings
    from specserve.engine import models

    settings = VerifierSettings()
    path, manifest = models.resolve(settings.model, settings.model_cache_dir)
    dtype = models.resolve_dtype(dtype, device, path, "--dtype")
    version = models.served_version(
        settings.model, models.fingerprint(path, manifest), dtype=dtype, device=device
    )
    cache = Path(settings.model_cache_dir) / "bench" / "acceptance" / version.replace(":", "_")
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer = models.load_tokenizer(path)
    model = flat = None
    pairs = []
    for row in rows:
        text = tokenizer.apply_chat_template(
            workloads.messages(row),
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = tokenizer(text).input_ids
        saved = cache / f"{row['question_id']}_{tokens}.json"
        if saved.exists():
            output = json.loads(saved.read_text())
        else:
            if flat is None:
                from specserve.engine.flat_model import FlatModel

                model = models.load_model(path, device, dtype)
                flat = FlatModel(model)
            started = time.perf_counter()
            output = greedy(flat, prompt, tokens, eos_ids(model, tokenizer))
            saved.write_text(json.dumps(output))
            print(
                f"target output {row['question_id']} ({row['category']}): {len(output)} tokens "
                f"in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
        pairs.append((prompt, output))
    return pairs, version


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


@torch.inference_mode()
def greedy(flat, prompt: list[int], tokens: int, eos: set[int]) -> list[int]:
    from specserve.engine.flat_model import Segment

    kv = flat.new_kv()
    try:
        (rows,) = flat.forward([Segment(kv, prompt)])
        out: list[int] = []
        while len(out) < tokens:
            out.append(int(rows[-1].argmax()))
            if out[-1] in eos:
                break
            (rows,) = flat.forward([Segment(kv, [out[-1]])])
        return out
    finally:
        kv.free()


# --- the proposers --------------------------------------------------------------------------
class PromptLookup:
    """Hugging Face's prompt lookup rule: the latest earlier occurrence of the history's last
    `ngram` tokens (2, then 1), and the `depth` tokens after it, as a chain."""

    def __init__(self, depth: int = 10, ngram: int = 2):
        self.depth, self.ngram = depth, ngram

    def propose(self, jobs):
        from specserve.speculation.tree import DraftTree

        trees = []
        for job in jobs:
            tree, tokens = DraftTree(model_free=True), job.tokens
            for n in range(min(self.ngram, len(tokens) - 1), 0, -1):
                tail = tokens[-n:]
                start = next(
                    (i for i in range(len(tokens) - n - 1, -1, -1) if tokens[i : i + n] == tail),
                    None,
                )
                if start is not None:
                    parent = -1
                    for token in tokens[start + n : start + n + self.depth]:
                        parent = tree.add(token, parent)
                    break
            trees.append(tree)
        return trees

    def forget(self, seq_id):
        pass

    def learn(self, tenant, tokens, prompt_len):
        pass


def make_proposer(name: str, dtype: str, device: str):
    from specserve.common.settings import DrafterSettings
    from specserve.speculation.ngram import NgramProposer
    from specserve.speculation.proposer import TreeShape
    from specserve.speculation.suffix import SuffixProposer

    section = yaml.safe_load(DEFAULT_CONFIG.read_text())["drafter"]
    settings = DrafterSettings(**{k: v for k, v in section.items() if k != "port"})
    settings = settings.model_copy(update={"device": device, "dtype": dtype})
    if name == "suffix":
        return SuffixProposer.from_settings(settings)
    if name == "ngram":
        return NgramProposer(TreeShape(max_depth=10))
    if name == "prompt_lookup":
        return PromptLookup()
    if name == "arctic":
        from .arctic import ArcticSuffix, ArcticUnavailable

        try:
            return ArcticSuffix()
        except ArcticUnavailable as e:
            raise SystemExit(f"--proposers arctic: {e}; or leave arctic out") from e
    from specserve.speculation import draft_model
    from specserve.speculation.hybrid import HybridProposer

    shape = {"chain": (6, 1, 1), "tree": (6, 2, 4), "hybrid": (6, 1, 1)}[name]
    settings = settings.model_copy(
        update=dict(zip(("max_depth", "branching", "width"), shape, strict=True))
    )
    settings = draft_model.with_dtype(settings)
    if name == "hybrid":
        return HybridProposer.from_settings(settings)
    return draft_model.DraftModelProposer.from_settings(settings)


def accepted(tree, reference: list[int]) -> int:
    """How many of `reference`'s tokens the tree's paths follow from its root."""
    children: dict[int, dict[int, int]] = defaultdict(dict)
    for node, (token, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
        children[parent].setdefault(token, node)
    node, count = -1, 0
    while count < len(reference) and (node := children[node].get(reference[count], -2)) != -2:
        count += 1
    return count


def kept_nodes(tree, reference: list[int]) -> np.ndarray:
    """Per node of the tree, whether `reference` follows the path from the root to it."""
    kept = np.zeros(len(tree), dtype=bool)
    depths = tree.depths()
    for node, (token, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
        d = depths[node]  # (the reference token it stands for)
        kept[node] = (parent == -1 or kept[parent]) and d < len(reference) and reference[d] == token
    return kept


def replay(proposer, name: str, prompt: list[int], output: list[int], qid: int) -> dict:
    from specserve.speculation.policy import SCORE_BINS, count_by_bin
    from specserve.speculation.proposer import DraftJob

    seq_id = f"{name}-{qid}"
    budget = 16 if name == "tree" else MODEL_BUDGET
    drafted, kept = 0, []
    by_bin = np.zeros((2, SCORE_BINS))  # (kept, checked) nodes by score bin: scored trees
    position = 0
    while position < len(output):
        job = DraftJob(seq_id, prompt + output[:position], budget, deep_budget=DEEP_BUDGET)
        tree = proposer.propose([job])[0]
        drafted += len(tree)
        if tree.scores:
            count_by_bin(*by_bin, tree.scores, kept_nodes(tree, output[position:]))
        kept.append(accepted(tree, output[position:]))
        position += kept[-1] + 1  # (and the target's own token)
    proposer.forget(seq_id)
    proposer.learn("", prompt + output, len(prompt))
    return {
        "steps": len(kept),
        "tokens": len(output),
        "drafted": drafted,
        "kept": kept,
        "by_bin": by_bin,
    }


def score_bins(kept: np.ndarray, checked: np.ndarray) -> list[dict]:
    """Per bin of node score (policy.SCORE_BINS): the nodes and the share of them whose path
    the target's output followed, what the verifier's score calibration learns
    (policy.ScoreCalibration)."""
    return [
        {
            "scores": f"{b / len(checked):.1f}-{(b + 1) / len(checked):.1f}",
            "nodes": int(n),
            "kept": round(float(k / n), 3) if n else None,
        }
        for b, (k, n) in enumerate(zip(kept, checked, strict=True))
    ]


def read_profile(path: Path) -> dict[int, float]:
    """A verify profile (ms of a pass by its tokens): the last "verify profile measured" line
    of a verifier's log, or a JSON map."""
    text = path.read_text()
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        lines = [json.loads(ln) for ln in text.splitlines() if "verify profile measured" in ln]
        found = lines[-1]["profile"] if lines else None
    if not isinstance(found, dict) or not found:
        sys.exit(
            f"no verify profile in {path}: pass a verifier's log at INFO (its 'verify profile "
            "measured' line) or a JSON map of ms by tokens"
        )
    return {int(n): float(ms) for n, ms in found.items()}


def pass_ms(profile: dict[int, float], tokens: int) -> float:
    """A pass of `tokens` tokens, interpolated in the profile (past its largest count, at the
    rate of its last two)."""
    counts = sorted(profile)
    if tokens <= counts[-1] or len(counts) < 2:
        return float(np.interp(tokens, counts, [profile[n] for n in counts]))
    a, b = counts[-2:]
    return profile[b] + (tokens - b) * (profile[b] - profile[a]) / (b - a)


def perfect_cut_speedup(runs: list[dict], profile: dict[int, float]) -> float:
    """Plain decoding's time over that of the runs' steps with each tree cut to its accepted
    path, both priced by `profile`."""
    plain = pass_ms(profile, 1) * sum(r["tokens"] for r in runs)
    return plain / sum(pass_ms(profile, k + 1) for r in runs for k in r["kept"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--per-category", type=int, default=2, help="questions per category")
    p.add_argument("--tokens", type=int, default=128, help="target output tokens per question")
    p.add_argument("--dtype", default="auto", help="of the target and the draft model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--proposers", default=",".join(PROPOSERS))
    p.add_argument(
        "--workload",
        default=WORKLOAD,
        help=f"comma-separated: {', '.join(workloads.NAMES)}, or .jsonl paths (see workloads.py)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="a verifier's log (or JSON of ms by tokens): adds perfect_cut_speedup",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    profile = read_profile(args.profile) if args.profile else None
    torch.set_num_threads(args.threads)
    names = args.proposers.split(",")
    unknown = set(names) - set(PROPOSERS)
    if unknown:
        p.error(f"unknown proposers {sorted(unknown)}; choose from {', '.join(PROPOSERS)}")
    rows = workloads.rows(args.workload, args.per_category)
    pairs, version = target_outputs(rows, args.tokens, args.dtype, args.device)
    results: dict[str, dict] = {}
    for name in names:
        proposer = make_proposer(name, args.dtype, args.device)
        started = time.perf_counter()
        by_category: dict[str, list[dict]] = defaultdict(list)
        for row, (prompt, output) in zip(rows, pairs, strict=True):
            by_category[row["category"]].append(
                replay(proposer, name, prompt, output, row["question_id"])
            )
        per_category = {
            category: {
                "tokens_per_step": round(
                    sum(r["tokens"] for r in runs) / sum(r["steps"] for r in runs), 3
                ),
                "drafted_per_step": round(
                    sum(r["drafted"] for r in runs) / sum(r["steps"] for r in runs), 2
                ),
                "questions": len(runs),
            }
            | (
                {"perfect_cut_speedup": round(perfect_cut_speedup(runs, profile), 3)}
                if profile
                else {}
            )
            for category, runs in by_category.items()
        }
        mean = statistics.mean(c["tokens_per_step"] for c in per_category.values())
        results[name] = {"mean_tokens_per_step": round(mean, 3), "categories": per_category}
        kept_by_bin, checked_by_bin = sum(r["by_bin"] for rs in by_category.values() for r in rs)
        if checked_by_bin.any():  # (a scored proposer: how its scores came true)
            results[name]["score_bins"] = score_bins(kept_by_bin, checked_by_bin)
            print(
                f"{name:>14}: kept by node score "
                + " ".join(
                    f"{b['scores']}={b['kept']} ({b['nodes']})" for b in results[name]["score_bins"]
                ),
                flush=True,
            )
        print(
            f"{name:>14}: {mean:.2f} tokens/step "
            f"({time.perf_counter() - started:.0f} s) "
            + " ".join(
                f"{c}={v['tokens_per_step']}"
                + (f" (cut {v['perfect_cut_speedup']}x)" if profile else "")
                for c, v in per_category.items()
            ),
            flush=True,
        )
        del proposer
    record = {
        "command": f"python -m benchmarks.acceptance --per-category {args.per_category} "
        f"--tokens {args.tokens} --dtype {args.dtype} --proposers {args.proposers} "
        f"--workload {args.workload}" + (f" --profile {args.profile}" if profile else ""),
        "python": platform.python_version(),  # (the code_edit workload's source is its stdlib)
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "target_version": version,
        "questions": [r["question_id"] for r in rows],
        "budgets": {"draft_model": MODEL_BUDGET, "tree": 16, "model_free": DEEP_BUDGET},
        "verify_profile_ms": profile,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(results, args.out / "acceptance.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = sorted({c for r in results.values() for c in r["categories"]})
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(1, len(results))
    for i, (name, result) in enumerate(results.items()):
        values = [result["categories"].get(c, {}).get("tokens_per_step", 0) for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30)
    ax.set_ylabel("tokens per step (accepted + 1)")
    ax.set_title("Spec-Bench replayed against the target's greedy output")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
