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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def read(path: Path) -> list[dict]:
    """The log's JSON lines (a service also prints plain lines, e.g. its ready line)."""
    return [json.loads(t) for t in path.read_text().splitlines() if t.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("log", type=Path, help="a verifier.log written at log_level DEBUG")
    p.add_argument("--json", action="store_true", help="one JSON object per request")
    args = p.parse_args()
    if not args.log.is_file():
        sys.exit(f"{args.log}: no such file (run the benchmark with --keep-logs DIR)")
    lines = read(args.log)
    if not any(x.get("msg") == "step" for x in lines):
        sys.exit(f"{args.log}: no step lines (run with --set verifier.log_level=DEBUG)")
    for row in requests(lines):
        if args.json:
            print(json.dumps(row))
        else:
            print(" ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
