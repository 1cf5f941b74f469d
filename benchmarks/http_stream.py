"""What streaming over the OpenAI-compatible HTTP API adds to time per output token, against
gRPC, in one run on one cluster.

    python -m benchmarks.http_stream [--rounds 12] [--tokens 200] [--concurrency 4]

The services as processes (scheduler, verifier, gateway; plain decoding, no drafter) on a
private redis-server, with a tiny random Qwen2 target (2 layers, hidden 64): its steps take a
few milliseconds, so what the gateway adds per token is not hidden behind a real model's step.
Each round runs `--concurrency` greedy requests of `--tokens` over gRPC (a `Generate` stream),
then as many over HTTP (/v1/completions with stream: true, server-sent events), with the same
prompt token ids; the order of the two alternates by round. Both clients are synchronous, one
thread per stream, in this process, and are timed the same way: time per output token =
(arrival of the last chunk - arrival of the first chunk with output) / (tokens - 1).
Writes <out>/http_stream.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from benchmarks import write_results
from benchmarks.long_output import tiny_config, tiny_model_dir
from specserve.common.settings import ServiceSettings
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def over_grpc(address: str, prompt: list[int], tokens: int) -> tuple[float, int]:
    """(time per output token, tokens) of one gRPC stream."""
    req = generation_pb2.GenerateRequest(
        max_tokens=tokens, sampling=common_pb2.SamplingParams(temperature=0)
    )
    req.prompt_ids.ids.extend(prompt)
    first = last = 0.0
    count = 0
    with grpc.insecure_channel(address) as channel:
        for chunk in generation_pb2_grpc.GenerationServiceStub(channel).Generate(req, timeout=600):
            last = time.perf_counter()
            if chunk.token_ids and not first:
                first = last
            if chunk.HasField("final"):
                count = chunk.final.usage.completion_tokens
    return (last - first) / max(1, count - 1), count


def over_http(port: int, model: str, prompt: list[int], tokens: int) -> tuple[float, int]:
    """(time per output token, tokens) of one HTTP SSE stream."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    first = last = 0.0
    count = 0
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):  # the last event (include_usage)
            count = event["usage"]["completion_tokens"]
            continue
        last = time.perf_counter()
        if event["choices"][0]["text"] and not first:
            first = last
    conn.close()
    return (last - first) / max(1, count - 1), count


def run_all(fn, args_list: list[tuple]) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = [(0.0, 0)] * len(args_list)

    def one(i: int) -> None:
        out[i] = fn(*args_list[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="streams at once per protocol")
    p.add_argument("--models", default=ServiceSettings().model_cache_dir, help="model cache")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    results: dict[str, list[tuple[float, int]]] = {"grpc": [], "http": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model_dir(Path(tmp), args.models))
        config = tiny_config(model, 2 * args.concurrency, gateway={"http_port": 0})
        cluster = LocalCluster(config, Path(tmp) / "cluster")
        cluster.start(timeout=300, services=("scheduler", "verifier", "gateway"))
        try:
            gateway = cluster.procs["gateway"]
            conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=30)
            conn.request("GET", "/v1/models")
            name = json.loads(conn.getresponse().read())["data"][0]["id"]
            conn.close()
            for r in range(-1, args.rounds):  # round -1 warms both paths up, unrecorded
                prompts = [[100 + r, 7 + i, 42, 9, 1000 + i] for i in range(args.concurrency)]
                order = ["grpc", "http"] if r % 2 == 0 else ["http", "grpc"]
                for protocol in order:
                    if protocol == "grpc":
                        calls = [(gateway.address, pr, args.tokens) for pr in prompts]
                        got = run_all(over_grpc, calls)
                    else:
                        calls = [(gateway.http_port, name, pr, args.tokens) for pr in prompts]
                        got = run_all(over_http, calls)
                    if r >= 0:
                        results[protocol].extend(got)
        finally:
            cluster.stop()
    tpot = {k: [t * 1000 for t, n in v if n > 1] for k, v in results.items()}
    median = {k: statistics.median(v) for k, v in tpot.items()}
    report = {
        "command": f"python -m benchmarks.http_stream --rounds {args.rounds} --tokens "
        f"{args.tokens} --concurrency {args.concurrency}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": "local cluster (scheduler, verifier, gateway as processes; private "
        "redis-server; plaintext, auth off), a tiny random Qwen2 target (2 layers, hidden 64) "
        f"in float32 on the CPU, 1 torch thread, plain decoding; {args.concurrency} greedy "
        f"streams at once per protocol, {args.tokens} tokens each, {args.rounds} rounds",
        "requests": {k: len(v) for k, v in tpot.items()},
        "tokens_per_request": {
            k: statistics.median(n for _, n in v) for k, v in results.items() if v
        },
        "tpot_ms_median": {k: round(v, 3) for k, v in median.items()},
        "tpot_ms_p90": {
            k: round(statistics.quantiles(v, n=10)[-1], 3) for k, v in tpot.items() if len(v) > 1
        },
        "http_over_grpc": round(median["http"] / median["grpc"], 3),
    }
    write_results(report, args.out, "http_stream")


if __name__ == "__main__":
    main()
