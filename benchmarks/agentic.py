"""A repeated agentic workload: 20 requests of one tenant share a tool-call JSON schema and the
shape of their answers (one JSON tool call each), one after another, through the cluster.

    python -m benchmarks.agentic [--requests 20] [--tokens 96] [--dtype float32]
                                 [--proposer hybrid] [--device cpu] [--out benchmarks/results]

The default pair, greedy, batch 1, the verifier's adaptive policy. The drafter runs the
default config's proposer (hybrid: suffix tree and the draft model's int8 chain of 6) unless
--proposer says otherwise. Each request is timed as benchmarks.speculative times a stream
(token arrivals at the client); request 1 finds nothing learned, request k the k-1 answers
before it. The first and last requests are also run with speculation off, for their own plain
rate. Auth is off, so every request is of one tenant (the empty one).
Writes <out>/agentic_<proposer>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import grpc
import torch

from specserve.tools.local_cluster import LocalCluster, free_port, without_security
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .speculative import SHORT, WARM_UP, start_drafter, timing

TOOLS = """You are an assistant that acts only through tools. Available tools, as JSON Schema:

{"name": "get_weather", "description": "Current weather for a city.",
 "parameters": {"type": "object", "properties": {
   "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
  "required": ["city", "unit"]}}
{"name": "search_flights", "description": "Flights between two airports on a date.",
 "parameters": {"type": "object", "properties": {
   "origin": {"type": "string", "description": "IATA code"},
   "destination": {"type": "string", "description": "IATA code"},
   "date": {"type": "string", "description": "YYYY-MM-DD"},
   "passengers": {"type": "integer"}},
  "required": ["origin", "destination", "date", "passengers"]}}
{"name": "book_hotel", "description": "Books a hotel room.",
 "parameters": {"type": "object", "properties": {
   "city": {"type": "string"}, "check_in": {"type": "string", "description": "YYYY-MM-DD"},
   "nights": {"type": "integer"}, "guests": {"type": "integer"}},
  "required": ["city", "check_in", "nights", "guests"]}}

Answer every request with exactly one JSON object and nothing else, in this form:
{"tool": "<tool name>", "arguments": {<every required argument>}, "reason": "<one sentence>"}"""

ASKS = [
    "What's the weather like in Lisbon right now? I prefer celsius.",
    "Find me flights from Boston to Denver on 2027-03-14 for two people.",
    "Book a hotel in Kyoto from 2027-04-02 for 3 nights, 2 guests.",
    "Is it cold in Oslo today? Use fahrenheit.",
    "I need a flight from SFO to JFK on 2027-01-20, just me.",
    "Reserve a room in Barcelona, checking in 2027-05-11, 4 nights, 1 guest.",
    "How hot is it in Phoenix? Celsius please.",
    "Search flights LHR to CDG on 2027-02-08 for 3 passengers.",
    "Get me a hotel in Chicago from 2027-06-01, 2 nights, 2 guests.",
    "Weather in Nairobi, in celsius.",
    "Flights from ORD to MIA on 2027-07-04 for a family of four.",
    "Book Vienna, check-in 2027-09-15, 5 nights, 2 guests.",
    "What's the temperature in Toronto? Fahrenheit.",
    "Find flights from SEA to ANC on 2027-08-21, one passenger.",
    "A hotel in Rome please: 2027-10-03, 3 nights, 3 guests.",
    "Current weather in Buenos Aires, celsius.",
    "Flights from DXB to BOM on 2027-11-12 for 2 people.",
    "Book a room in Prague from 2027-12-20 for 6 nights, 1 guest.",
    "Is it raining in Dublin? Celsius.",
    "Search flights from ATL to LAX on 2027-03-30 for 5 passengers.",
]


def ask(stub, question: str, tokens: int, speculate: bool) -> dict:
    mode = common_pb2.SPECULATION_MODE_AUTO if speculate else common_pb2.SPECULATION_MODE_OFF
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens, speculation=common_pb2.SpeculationOptions(mode=mode)
    )
    req.messages.messages.add(role="system", content=TOOLS)
    req.messages.messages.add(role="user", content=question)
    ids, arrivals, final, text = [], [], None, []
    started = time.perf_counter()
    for chunk in stub.Generate(req, timeout=1800):
        if chunk.token_ids:
            ids.extend(chunk.token_ids)
            arrivals.append((time.perf_counter(), len(ids)))
            text.append(chunk.text)
        if chunk.HasField("final"):
            final = chunk.final
    spec = final.speculation
    return timing(started, arrivals) | {
        "seconds": round(arrivals[-1][0] - started, 2),
        "steps": spec.steps,
        "mean_accepted_length": round(spec.mean_accepted_length, 2),
        "text": "".join(text),
        "ids": ids,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=20, choices=range(2, len(ASKS) + 1))
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--proposer", default="hybrid", choices=["hybrid", "suffix", "draft_model"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (target and draft)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    drafter_port = free_port()
    drafter = {
        "proposer": args.proposer,
        "dtype": "int8",
        "branching": 1,
        "width": 1,
        "max_depth": 6,
        "torch_threads": args.threads,
        "device": args.device,
    }
    config = {
        "verifier": {
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": 1,
            "interactive_reserved_slots": 0,
            "torch_threads": args.threads,
            "speculative_decoding": True,
            "speculation_policy": "adaptive",
            "verification_tree_size": 6,  # as config/specserve.yaml
            "drafter_addresses": [f"127.0.0.1:{drafter_port}"],
            "draft_timeout_seconds": 60,
        },
        "drafter": drafter,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(config), Path(tmp))
        try:
            cluster.start(timeout=600, services=("scheduler", "verifier", "gateway"))
            ran = start_drafter(cluster, drafter, drafter_port)
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                warm = generation_pb2.GenerateRequest(max_tokens=WARM_UP[1])
                warm.messages.messages.add(role="user", content=WARM_UP[0])
                list(stub.Generate(warm, timeout=600))  # connects the drafter; learns nothing
                for i, question in enumerate(ASKS[: args.requests], 1):  # of the tool schema
                    r = ask(stub, question, args.tokens, speculate=True)
                    rows.append({"request": i} | r)
                    print(
                        f"request {i:>2}: {r['decode_tokens_per_s']} tok/s, {r['steps']} steps, "
                        f"accepted length {r['mean_accepted_length']}, {r['seconds']} s",
                        flush=True,
                    )
                # Own plain rates last, so that they shape nothing above.
                plain = {
                    n: ask(stub, ASKS[n - 1], args.tokens, speculate=False)
                    for n in (1, args.requests)
                }
        finally:
            cluster.stop()
    first, last = rows[0], rows[-1]
    for n, r in plain.items():
        assert r["ids"] == rows[n - 1]["ids"], f"request {n}: plain output differs"
    report = {
        "command": f"python -m benchmarks.agentic --requests {args.requests} --tokens "
        f"{args.tokens} --dtype {args.dtype} --proposer {args.proposer} --device {args.device}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, "
        f"device {args.device}",
        "configuration": f"target qwen2.5-coder-1.5b-instruct {args.dtype}; drafter "
        f"{args.proposer}, draft model in {SHORT[ran]} chain 6; verifier adaptive policy, "
        "verification_tree_size 6, deep_tree_size 64; greedy; batch 1; one tenant",
        "timing": "token arrivals at the client on time.perf_counter (as benchmarks.speculative)",
        "last_over_first_decode": round(
            last["decode_tokens_per_s"] / first["decode_tokens_per_s"], 2
        ),
        "last_over_first_seconds": round(first["seconds"] / last["seconds"], 2),
        "plain": {
            str(n): {k: v for k, v in r.items() if k not in ("ids", "text")}
            for n, r in plain.items()
        },
        "requests": [{k: v for k, v in r.items() if k != "ids"} for r in rows],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"agentic_{args.proposer}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "requests"}, indent=1))


if __name__ == "__main__":
    main()
