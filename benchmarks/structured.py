"""Structured outputs through the cluster, default config: a JSON-extraction and a tool-call
workload, each with speculation on and off and the grammar on and off, and with the grammar's
forced tokens drafted or not, in one run.

    python -m benchmarks.structured [--extraction 6] [--tools 6] [--tokens 96] [--dtype auto]
                                    [--out benchmarks/results]

- Extraction: the first --extraction questions of Spec-Bench's extraction category
  (`shared/workloads/spec_bench/question.jsonl`), each asked to answer as JSON of one schema
  (a list of {field, value} records), which the grammar then enforces.
- Tool calls: --tools requests to an assistant with three tools (TOOLS below), answering with
  one call as JSON ({"name", "arguments"}); the grammar is the union of the three calls'
  schemas.
Every prompt says what JSON to write, so the outputs with the grammar off are comparable
ones, only unenforced. Greedy, one stream at a time, timed at the client as
benchmarks.speculative times a stream (decode tokens/s after the first token). Modes, in
this order for each prompt (so a drifting machine moves them alike): grammar off with
speculation off and on, grammar on with speculation off and on, then grammar on with
speculation on and forced drafting off (on a second cluster, started beside the first, whose
verifier has `forced_drafts: false`). Per mode and workload: mean decode tokens/s, mean accepted
length (tokens per step), and the share of outputs that parse as JSON.
Writes <out>/structured.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from . import workloads
from .spec_bench import cluster_config
from .speculative import timing

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"field": {"type": "string"}, "value": {"type": "string"}},
                "required": ["field", "value"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
TOOLS = {
    "get_weather": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "search_code": {
        "query": {"type": "string"},
        "language": {"enum": ["python", "rust", "go", "typescript"]},
        "max_results": {"type": "integer"},
    },
    "create_ticket": {
        "title": {"type": "string"},
        "priority": {"enum": ["low", "medium", "high"]},
        "labels": {"type": "array", "items": {"type": "string"}},
    },
}
TOOL_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": {
                    "type": "object",
                    "properties": props,
                    "required": list(props),
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, props in TOOLS.items()
    ]
}
TOOL_REQUESTS = [
    "What's the weather like in Lisbon right now, in celsius?",
    "Find Python code that parses ISO 8601 dates, at most 5 results.",
    "Open a high priority ticket: the login page times out; label it auth and frontend.",
    "Is it going to be hot in Phoenix today? Use fahrenheit.",
    "Search our Rust code for uses of unsafe blocks; show 10 results.",
    "File a low priority ticket to update the README's install section, label docs.",
]
MODES = {  # name: (grammar, speculation, verifier config)
    "plain": (False, False, "forced"),
    "speculative": (False, True, "forced"),
    "grammar": (True, False, "forced"),
    "grammar+speculative": (True, True, "forced"),
    "grammar+speculative, no forced drafts": (True, True, "unforced"),
}


def prompts(extraction: int, tools: int) -> list[dict]:
    rows = workloads.rows("spec_bench", extraction)
    asked = [r for r in rows if r["category"] == "extraction"][:extraction]
    schema = json.dumps(EXTRACTION_SCHEMA)
    out = [
        {
            "workload": "extraction",
            "prompt": f"{r['turns'][0]}\n\nAnswer only with JSON matching this schema: {schema}",
            "schema": schema,
        }
        for r in asked
    ]
    tools_text = json.dumps(TOOLS)
    for request in TOOL_REQUESTS[:tools]:
        out.append(
            {
                "workload": "tool call",
                "prompt": f"You can call these tools (name: parameters): {tools_text}\n"
                'Answer only with one call as JSON: {"name": ..., "arguments": {...}}.\n\n'
                f"Request: {request}",
                "schema": json.dumps(TOOL_SCHEMA),
            }
        )
    return out


def stream(stub, row: dict, tokens: int, grammar: bool, speculation: bool) -> dict:
    mode = common_pb2.SPECULATION_MODE_AUTO if speculation else common_pb2.SPECULATION_MODE_OFF
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens, speculation=common_pb2.SpeculationOptions(mode=mode)
    )
    if grammar:
        req.grammar.json_schema = row["schema"]
    req.messages.messages.add(role="user", content=row["prompt"])
    arrivals, final, text, count = [], None, [], 0
    started = time.perf_counter()
    for chunk in stub.Generate(req, timeout=3600):
        text.append(chunk.text)
        if chunk.token_ids:
            count += len(chunk.token_ids)
            arrivals.append((time.perf_counter(), count))
        if chunk.HasField("final"):
            final = chunk.final
    try:
        json.loads("".join(text))
        parses = True
    except ValueError:
        parses = False
    return timing(started, arrivals) | {
        "mean_accepted_length": final.speculation.mean_accepted_length,
        "parses": parses,
        "finish": common_pb2.FinishReason.Name(final.finish_reason),
    }


def run(rows: list[dict], args) -> dict:
    """Both verifier configs' clusters started first, then each prompt in every mode in
    turn (all five within a minute or two of each other)."""
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    clusters, channels, stubs = {}, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for config in ("forced", "unforced"):
                settings = cluster_config([1], args.dtype)
                settings["verifier"]["forced_drafts"] = config == "forced"
                clusters[config] = LocalCluster(without_security(settings), Path(tmp) / config)
                clusters[config].start(timeout=900)
                channels.append(grpc.insecure_channel(clusters[config].procs["gateway"].address))
                stubs[config] = generation_pb2_grpc.GenerationServiceStub(channels[-1])
                stream(stubs[config], rows[0] | {"prompt": "Say hi."}, 8, True, True)  # warm-up
            for row in rows:
                for mode, (grammar, speculation, config) in MODES.items():
                    r = stream(stubs[config], row, args.tokens, grammar, speculation)
                    results[mode].append(r | {"workload": row["workload"]})
                    print(mode, row["workload"], r, flush=True)
        finally:
            for channel in channels:
                channel.close()
            for cluster in clusters.values():
                cluster.stop()
    return results


def summary(results: dict[str, list[dict]]) -> dict:
    out: dict[str, dict] = {}
    for mode, rs in results.items():
        for workload in sorted({r["workload"] for r in rs}):
            mine = [r for r in rs if r["workload"] == workload]
            out.setdefault(workload, {})[mode] = {
                "decode_tokens_per_s": round(
                    statistics.mean(r["decode_tokens_per_s"] or 0 for r in mine), 2
                ),
                "mean_accepted_length": round(
                    statistics.mean(r["mean_accepted_length"] for r in mine), 2
                ),
                "parses_as_json": f"{sum(r['parses'] for r in mine)}/{len(mine)}",
                "tokens": sum(r["tokens"] for r in mine),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--extraction", type=int, default=6)
    p.add_argument("--tools", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--dtype", default="auto", help="target and drafter")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    rows = prompts(args.extraction, args.tools)
    results = run(rows, args)
    table = summary(results)
    for workload, modes in table.items():
        for mode, row in modes.items():
            print(f"{workload:10} {mode:40} {row}")
    record = {
        "command": f"python -m benchmarks.structured --extraction {args.extraction} "
        f"--tools {args.tools} --tokens {args.tokens} --dtype {args.dtype}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "summary": table,
        "streams": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
