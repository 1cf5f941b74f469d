"""Time to first token when users share a long system prompt, with automatic prefix caching
and without it, and what isolating tenants costs.

    python -m benchmarks.prefix_cache [--users 8] [--rounds 2] [--tenants 2] [--dtype bfloat16]

One cluster with the default target (plain decoding, so that only prefill differs) per
setting: the prefix cache on with `gateway.prefix_cache_scope: global`, on with `tenant` (the
default), and off (the control). API keys are on; the users belong to `--tenants` tenants in
turn (user u to tenant u mod N), one key each. Each round, `--users` users send the same
~1,000-token system prompt with a question of their own, one after another and with no
session_id; each round's system prompt is new (numbered), so user 1 always finds it cold.
Under `tenant` scope the first user of each tenant finds it cold too: that is the cost of
isolation. Reports TTFT at the client and the prompt tokens taken from the cache; the figure
of merit is user 1's TTFT over the median of users 2..N's. Writes <out>/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import redis

from specserve.common.settings import DEFAULT_TIERS
from specserve.gateway.keys import KeyStore
from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import generation_pb2, generation_pb2_grpc

QUESTIONS = [
    "How do I reverse a list in place?",
    "Write a function that checks whether a string is a palindrome.",
    "What does a context manager do?",
    "Explain list comprehensions with one example.",
    "How do I read a file line by line?",
    "What is the difference between a tuple and a list?",
    "Write a function that returns the n-th Fibonacci number.",
    "How do I sort a dictionary by its values?",
    "How do I merge two dictionaries?",
    "What is a generator?",
]

RULES = [
    "Answer in plain English and keep every answer short.",
    "Prefer the standard library over third-party packages.",
    "Show code in one block, with type hints and a docstring.",
    "Name variables after what they hold, never after their type.",
    "Point out edge cases: empty input, None, very large input.",
    "Never invent an API: say so when you are not sure it exists.",
    "Explain an error by its cause first, then the fix.",
    "Prefer small pure functions to classes with state.",
]


def system_prompt(round_index: int, words: int = 700) -> str:
    """A numbered assistant policy of about `words` words (~1,000 tokens)."""
    lines = [f"You are coding assistant #{round_index}. Follow these rules."]
    n = 0
    while sum(len(line.split()) for line in lines) < words:
        lines.append(f"Rule {n + 1}: {RULES[n % len(RULES)]} (section {n // len(RULES) + 1})")
        n += 1
    return "\n".join(lines)


SETTINGS = {  # name: (verifier.prefix_cache, gateway.prefix_cache_scope)
    "on_global": (True, "global"),
    "on_tenant": (True, "tenant"),
    "off": (False, "tenant"),
}


def ask(stub, key: str, system: str, question: str, tokens: int) -> dict:
    req = generation_pb2.GenerateRequest(max_tokens=tokens)
    req.messages.messages.add(role="system", content=system)
    req.messages.messages.add(role="user", content=question)
    started = time.perf_counter()
    ttft, final = None, None
    metadata = [("authorization", f"Bearer {key}")]
    for chunk in stub.Generate(req, timeout=1800, metadata=metadata):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - started
        if chunk.HasField("final"):
            final = chunk.final
    return {
        "ttft_s": round(ttft, 3),
        "prompt_tokens": final.usage.prompt_tokens,
        "cached_prompt_tokens": final.usage.cached_prompt_tokens,
    }


def run(args, setting: str) -> list[list[dict]]:
    prefix_cache, scope = SETTINGS[setting]
    config = without_security(
        {
            "gateway": {"prefix_cache_scope": scope},
            "verifier": {
                "device": args.device,
                "dtype": args.dtype,
                "speculative_decoding": False,
                "prefix_cache": prefix_cache,
            },
        }
    )
    config["gateway"]["auth"] = "api_key"
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(config, Path(tmp)).start(
            timeout=900, services=("scheduler", "verifier", "gateway")
        )
        try:
            store = KeyStore(redis.Redis.from_url(cluster.redis_url, decode_responses=True))
            tier = DEFAULT_TIERS["batch"]  # (no rate limit in the way)
            keys = [store.create(f"tenant-{t}", "batch", tier) for t in range(args.tenants)]
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                ask(stub, keys[0], "Be brief.", "Say hi.", 4)  # warm up
                for r in range(args.rounds):
                    system = system_prompt(r + 1 + 100 * list(SETTINGS).index(setting))
                    users = [
                        ask(
                            stub,
                            keys[u % args.tenants],
                            system,
                            QUESTIONS[u % len(QUESTIONS)],
                            args.tokens,
                        )
                        for u in range(args.users)
                    ]
                    rounds.append(users)
                    print(json.dumps({"setting": setting, "users": users}), flush=True)
        finally:
            cluster.stop()
    return rounds


def summary(rounds: list[list[dict]]) -> dict:
    first = statistics.median(users[0]["ttft_s"] for users in rounds)
    rest = statistics.median(u["ttft_s"] for users in rounds for u in users[1:])
    others = [u for users in rounds for u in users[1:]]
    return {
        "user1_ttft_s": first,
        "users2_n_median_ttft_s": rest,
        "users2_n_mean_ttft_s": round(statistics.mean(u["ttft_s"] for u in others), 3),
        "users2_n_cold": sum(u["cached_prompt_tokens"] == 0 for u in others),  # of len(others)
        "user1_over_others": round(first / rest, 2),
        "prompt_tokens": rounds[0][0]["prompt_tokens"],
        "cached_prompt_tokens_users2_n": sorted(
            {u["cached_prompt_tokens"] for users in rounds for u in users[1:]}
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8, help="max_tokens of each request")
    p.add_argument("--tenants", type=int, default=2, help="tenants the users belong to, in turn")
    p.add_argument("--settings", default=",".join(SETTINGS), help="of " + ", ".join(SETTINGS))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    settings = args.settings.split(",")
    if unknown := set(settings) - set(SETTINGS):
        p.error(f"--settings: unknown {sorted(unknown)}; known: {', '.join(SETTINGS)}")
    results = {setting: run(args, setting) for setting in settings}
    report = {
        "command": f"python -m benchmarks.prefix_cache --users {args.users} --rounds "
        f"{args.rounds} --tokens {args.tokens} --tenants {args.tenants} --settings "
        f"{args.settings} --dtype {args.dtype} --device {args.device}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": f"default target, {args.dtype}, {args.device}, plain decoding, "
        f"no session_id; one request at a time; users of {args.tenants} tenants in turn",
        **{setting: summary(rounds) for setting, rounds in results.items()},
        "rounds": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
