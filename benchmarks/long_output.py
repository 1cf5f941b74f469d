"""Minutes-long outputs: one request of `--tokens` (8,000) output tokens through the whole local
cluster, its gateway SIGKILLed at the middle and started again on its port; the client
re-attaches with resume_from.

    python -m benchmarks.long_output [--tokens 8000] [--batch 4] [--kill-at 0.5]

The services as processes (scheduler, verifier, gateway; plain decoding, no drafter) on a
private redis-server, with a tiny random Qwen2 target (2 layers, hidden 64, 16k positions)
and the default model's tokenizer: what grows with the output (the KV, the attention over it,
the output stream in Redis, the resume's read of it) shows, where a real model's weights would
hide it on this CPU. `--batch` requests run at once, each of `--tokens`. Reported: tokens per
second per request over each tenth of the output (the cost of the length; the tenth with the
kill holds the restart too), the time from the
kill to the first token after it (the gateway's restart and the re-attach), whether every
request got every index once and equal to what Redis holds, and the wall time.
Writes <out>/long_output_<tokens>.json.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

from benchmarks import write_results
from benchmarks.kv_concurrency import tiny_qwen
from specserve.common.settings import ModelRef, ServiceSettings
from specserve.engine import models
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster, free_port, without_security
from specserve.v1 import generation_pb2, generation_pb2_grpc


class Reader:
    """A client that re-attaches (resume_from its next index) whenever its stream breaks."""

    def __init__(self, rid: str, prompt: list[int], max_tokens: int):
        self.rid, self.prompt, self.max_tokens = rid, prompt, max_tokens
        self.arrivals: list[tuple[float, int, int]] = []  # (time, first index, count)
        self.ids: list[int] = []
        self.final = None
        self.reattached = 0
        self.error = ""

    def run(self, address: str, give_up_s: float) -> None:
        deadline = time.monotonic() + give_up_s
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            while time.monotonic() < deadline and self.final is None:
                if self.arrivals or self.reattached:
                    req = generation_pb2.GenerateRequest(
                        request_id=self.rid, resume_from=len(self.ids)
                    )
                else:
                    req = generation_pb2.GenerateRequest(
                        request_id=self.rid, max_tokens=self.max_tokens
                    )
                    req.prompt_ids.ids.extend(self.prompt)
                try:
                    for chunk in stub.Generate(req, timeout=give_up_s):
                        if chunk.token_ids:
                            assert chunk.first_index == len(self.ids), "a gap or a repeat"
                            self.ids.extend(chunk.token_ids)
                            self.arrivals.append(
                                (time.monotonic(), chunk.first_index, len(chunk.token_ids))
                            )
                        if chunk.HasField("final"):
                            self.final = chunk.final
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        self.error = f"{e.code().name}: {e.details()}"
                        return
                    self.reattached += 1
                    time.sleep(0.2)  # a client's retry backoff


def tiny_model_dir(root: Path, models_dir: str) -> Path:
    path = root / "tiny"
    torch.manual_seed(0)
    tiny_qwen().save_pretrained(path)
    tokenizer_dir, _ = models.resolve(ModelRef(), models_dir)
    models.load_tokenizer(tokenizer_dir).save_pretrained(path)
    return path


def tiny_config(model: str, batch_size: int, gateway: dict | None = None, **verifier) -> dict:
    """A local cluster's config (plaintext, auth off) for the tiny target at `model`: float32,
    plain decoding, one torch thread, `batch_size` slots."""
    return without_security(
        {
            "gateway": {"model": {"path": model}, **(gateway or {})},
            "verifier": {
                "model": {"path": model},
                "dtype": "float32",
                "batch_size": batch_size,
                "speculative_decoding": False,
                "torch_threads": 1,
                **verifier,
            },
        }
    )


def tenths(reader: Reader, tokens: int) -> list[float]:
    """Tokens per second over each tenth of the output (by index)."""
    out = []
    for k in range(10):
        lo, hi = k * tokens // 10, (k + 1) * tokens // 10
        times = [t for t, first, n in reader.arrivals if lo <= first < hi]
        count = sum(n for _, first, n in reader.arrivals if lo <= first < hi)
        out.append(round(count / (times[-1] - times[0]), 1) if len(times) > 1 else 0.0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--batch", type=int, default=4, help="requests at once")
    p.add_argument("--kill-at", type=float, default=0.5, help="share of the output")
    p.add_argument("--models", default=ServiceSettings().model_cache_dir, help="model cache")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model_dir(Path(tmp), args.models))
        config = tiny_config(model, args.batch, interactive_reserved_slots=0)
        cluster = LocalCluster(config, Path(tmp) / "cluster")
        started = time.monotonic()
        cluster.start(
            timeout=300, gateway_port=free_port(), services=("scheduler", "verifier", "gateway")
        )
        try:
            address = cluster.procs["gateway"].address
            readers = [
                Reader(f"long-{i}", [100 + i, 7, 42, 9, 1000 + i], args.tokens)
                for i in range(args.batch)
            ]
            threads = [
                threading.Thread(target=r.run, args=(address, 3600), daemon=True) for r in readers
            ]
            began = time.monotonic()
            for t in threads:
                t.start()
            kill_at = int(args.kill_at * args.tokens)
            while min(len(r.ids) for r in readers) < kill_at:
                time.sleep(0.05)
            port = cluster.procs["gateway"].port
            killed = time.monotonic()
            cluster.kill("gateway", signal.SIGKILL)
            env = {"SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": cluster.procs["scheduler"].address}
            cluster.start_service("gateway", env, port=port)
            cluster.wait_ready("gateway", 300)
            for t in threads:
                t.join(timeout=3600)
            wall = time.monotonic() - began
            store = RequestStore.from_url(cluster.redis_url)
            exact = [r.ids == store.progress(r.rid) for r in readers]
        finally:
            cluster.stop()
    after = [min((t for t, _, _ in r.arrivals if t > killed), default=0.0) for r in readers]
    per_request = [tenths(r, args.tokens) for r in readers]
    report = {
        "command": f"python -m benchmarks.long_output --tokens {args.tokens} --batch "
        f"{args.batch} --kill-at {args.kill_at:g}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": "local cluster (scheduler, verifier, gateway as processes; private "
        "redis-server), a tiny random Qwen2 target (2 layers, hidden 64) in float32 on the "
        f"CPU, 1 torch thread, plain decoding, {args.batch} requests at once, gateway "
        f"SIGKILLed at {args.kill_at:.0%} of the output and restarted on its port",
        "tokens_per_request": [len(r.ids) for r in readers],
        "finish_reasons": [r.final.finish_reason if r.final else None for r in readers],
        "errors": [r.error for r in readers if r.error],
        "every_index_once_equal_to_redis": all(exact),
        "reattached": [r.reattached for r in readers],
        "kill_to_next_token_s": [round(a - killed, 2) if a else None for a in after],
        "tokens_per_s_per_request_by_tenth": [
            round(statistics.mean(col), 1) for col in zip(*per_request, strict=True)
        ],
        "wall_s": round(wall, 1),
        "cluster_start_s": round(began - started, 1),
    }
    write_results(report, args.out, f"long_output_{args.tokens}")


if __name__ == "__main__":
    main()
