"""What the verifier did for each request, from its DEBUG log: where speculation spent time.

    python -m benchmarks.step_log DIR/verifier.log [--json]

The log of a cluster run with `--set verifier.log_level=DEBUG --keep-logs DIR`
(benchmarks.llamacpp, benchmarks.spec_bench) has a "step" line per forward pass, a "drafted"
line per ask of the drafters, a "checked" line per tree the target checked and a "shadowed"
line per tree not checked in full, once the tokens that followed decided its other nodes. Taken one
request at a time (between its "admitted" and "request ended" lines, so streams must not
overlap), this sums per request:

- steps: decode steps (those that took in no prompt), and their median one-token pass (ms);
- trees: steps that checked draft nodes, the nodes and the tokens kept of them;
- tree_ms: what those steps took beyond a one-token pass each (the time the nodes added);
- asks and draft_ms: drafter round trips and their time, and those that grew draft-model trees;
- shadow_nodes, shadow_kept: the nodes of trees left unchecked, and how many of them the
  tokens that followed kept (what the policy learned from without paying for them).

tree_ms + draft_ms against steps x the one-token pass is what speculation cost the request,
read off its own steps: unlike tokens/s, it does not move with the other load on the machine
minute to minute (one-token passes of back-to-back requests here differed by up to 15%).

With --groups, requests that overlap are summed as one group (from an "admitted" line while
none runs to the "request ended" line that leaves none running: a group of
benchmarks.spec_bench, whose groups alternate speculation on and off): its wall time, its
steps and those that took in prompt tokens with their verify time, the median time between two
decode steps outside the later one's forward pass and the drafter's answer (`between_ms`: the
engine's and the policy's own work a step), the asks and their time, the nodes checked and the
tokens kept of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path


def requests(lines: list[dict]) -> list[dict]:
    """One summary per request, in the order they were admitted."""
    out, current = [], None
    for line in lines:
        msg = line.get("msg")
        if msg == "admitted":
            current = {"request_id": line["request_id"], "lines": []}
        elif current is not None and msg == "request ended":
            if line["request_id"] == current["request_id"]:
                out.append(summary(current["request_id"], current["lines"], line["tokens"]))
                current = None
        elif current is not None and msg in ("step", "drafted", "checked", "shadowed"):
            current["lines"].append(line)
    return out


def summary(request_id: str, lines: list[dict], tokens: int) -> dict:
    steps = [x for x in lines if x["msg"] == "step" and x["prefill_tokens"] == 0]
    one = [x["verify_ms"] for x in steps if x["tokens"] == 1]
    single = statistics.median(one) if one else 0.0
    trees = [x for x in steps if x["tokens"] > 1]
    checked = [x for x in lines if x["msg"] == "checked"]
    drafted = [x for x in lines if x["msg"] == "drafted"]
    model = [x for x in drafted if any(k for k, _ in x["budgets"])]
    shadowed = [x for x in lines if x["msg"] == "shadowed"]
    return {
        "request_id": request_id,
        "tokens": tokens,
        "steps": len(steps),
        "one_token_ms": round(single, 1),
        "trees": len(trees),
        "nodes": sum(x["nodes"] for x in checked),
        "kept": sum(x["accepted"] for x in checked),
        "tree_ms": round(sum(x["verify_ms"] - single for x in trees)),
        "asks": len(drafted),
        "draft_ms": round(sum(x["draft_ms"] for x in drafted)),
        "model_asks": len(model),
        "model_draft_ms": round(sum(x["draft_ms"] for x in model)),
        "shadow_nodes": sum(x["nodes"] for x in shadowed),
        "shadow_kept": sum(x["kept"] for x in shadowed),
    }


def groups(lines: list[dict]) -> list[dict]:
    """One summary per group of overlapping requests, in order (see the module's docstring)."""
    out, current, running = [], None, 0
    for line in lines:
        msg = line.get("msg")
        if msg == "admitted":
            if running == 0:
                current = []
            running += 1
        if current is not None:
            current.append(line)
        if msg == "request ended" and current is not None:
            running -= 1
            if running == 0:
                out.append(group_summary(current))
                current = None
    return out


def group_summary(lines: list[dict]) -> dict:
    steps = [x for x in lines if x.get("msg") == "step"]
    prompt = [x for x in steps if x["prefill_tokens"]]
    drafted = [x for x in lines if x.get("msg") == "drafted"]
    checked = [x for x in lines if x.get("msg") == "checked"]
    between, last, asked = [], None, 0.0
    for line in lines:
        if line.get("msg") == "drafted":
            asked += line["draft_ms"]
        elif line.get("msg") == "step":
            if last is not None and not last["prefill_tokens"] and not line["prefill_tokens"]:
                gap = 1000 * (_seconds(line["ts"]) - _seconds(last["ts"]))
                between.append(gap - line["verify_ms"] - asked)
            last, asked = line, 0.0
    return {
        "requests": sum(x.get("msg") == "admitted" for x in lines),
        "wall_s": round(_seconds(lines[-1]["ts"]) - _seconds(lines[0]["ts"]), 2),
        "steps": len(steps),
        "prompt_steps": len(prompt),
        "verify_s": round(sum(x["verify_ms"] for x in steps) / 1000, 2),
        "prompt_verify_s": round(sum(x["verify_ms"] for x in prompt) / 1000, 2),
        "between_ms": round(statistics.median(between), 2) if between else None,
        "asks": len(drafted),
        "draft_ms": round(sum(x["draft_ms"] for x in drafted)),
        "nodes": sum(x["nodes"] for x in checked),
        "kept": sum(x["accepted"] for x in checked),
    }


def _seconds(ts: str) -> float:
    """A log line's time ("2026-12-07T17:18:47.671Z") in seconds."""
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def read(path: Path) -> list[dict]:
    """The log's JSON lines (a service also prints plain lines, e.g. its ready line)."""
    return [json.loads(t) for t in path.read_text().splitlines() if t.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("log", type=Path, help="a verifier.log written at log_level DEBUG")
    p.add_argument("--json", action="store_true", help="one JSON object per request (or group)")
    p.add_argument(
        "--groups", action="store_true", help="sum overlapping requests as one group each"
    )
    args = p.parse_args()
    if not args.log.is_file():
        sys.exit(f"{args.log}: no such file (run the benchmark with --keep-logs DIR)")
    lines = read(args.log)
    if not any(x.get("msg") == "step" for x in lines):
        sys.exit(f"{args.log}: no step lines (run with --set verifier.log_level=DEBUG)")
    for row in (groups if args.groups else requests)(lines):
        if args.json:
            print(json.dumps(row))
        else:
            print(" ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
