"""Time to first token of a conversation's second turn, with and without the prefix cache.

    python -m benchmarks.prefix_cache [--rounds 3] [--dtype bfloat16]

One cluster with the default target (plain decoding, so that only prefill differs). Each round:
turn 1 (the code-editing prompt, a 50-line class) with a session id; then the same turn 2
(turn 1, its answer and a follow-up question) twice: once in the session (its verifier holds
turn 1's KV and computes only the new tokens) and once without a session (the whole prompt is
prefilled). Reports TTFT taken at the client and the prompt tokens taken from the cache.
Writes <out>/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from specserve.local_cluster import LocalCluster, without_security
from specserve.v1 import generation_pb2, generation_pb2_grpc

from .prompts import PROMPTS

KEPT = ("ttft_s", "cached_prompt_tokens")


def turn(stub, messages: list[tuple[str, str]], tokens: int, session: str) -> dict:
    req = generation_pb2.GenerateRequest(max_tokens=tokens, session_id=session)
    for role, content in messages:
        req.messages.messages.add(role=role, content=content)
    started = time.perf_counter()
    ttft, text, final = None, "", None
    for chunk in stub.Generate(req, timeout=1800):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - started
        text += chunk.text
        if chunk.HasField("final"):
            final = chunk.final
    return {
        "ttft_s": round(ttft, 3),
        "prompt_tokens": final.usage.prompt_tokens,
        "cached_prompt_tokens": final.usage.cached_prompt_tokens,
        "text": text,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each turn")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    config = {
        "verifier": {"device": args.device, "dtype": args.dtype, "speculative_decoding": False}
    }
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(without_security(config), Path(tmp)).start(
            timeout=900, services=("scheduler", "verifier", "gateway")
        )
        try:
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                turn(stub, [("user", "Say hi.")], 4, "")  # warm up
                for i in range(args.rounds):
                    first = [("user", PROMPTS["edit"])]
                    one = turn(stub, first, args.tokens, f"bench-{i}")
                    second = first + [
                        ("assistant", one["text"]),
                        ("user", "Now add a docstring to every method."),
                    ]
                    cached = turn(stub, second, args.tokens, f"bench-{i}")
                    cold = turn(stub, second, args.tokens, "")
                    rounds.append(
                        {
                            "turn2_prompt_tokens": cached["prompt_tokens"],
                            "with_session": {
                                k: cached[k] for k in ("ttft_s", "cached_prompt_tokens")
                            },
                            "without_session": {
                                k: cold[k] for k in ("ttft_s", "cached_prompt_tokens")
                            },
                        }
                    )
                    print(json.dumps(rounds[-1]), flush=True)
        finally:
            cluster.stop()
    warm = statistics.median(r["with_session"]["ttft_s"] for r in rounds)
    cold = statistics.median(r["without_session"]["ttft_s"] for r in rounds)
    report = {
        "command": f"python -m benchmarks.prefix_cache --rounds {args.rounds} --tokens "
        f"{args.tokens} --dtype {args.dtype} --device {args.device}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "median_ttft_s": {"with_session": warm, "without_session": cold},
        "ttft_ratio": round(warm / cold, 3),
        "rounds": rounds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
