"""Thousands of open streams on one gateway process: the delay the gateway adds to each token,
and what the streams cost it.

    python -m benchmarks.scale [--streams 2000] [--seconds 20] [--step-ms 200] [--batch 64]

One real gateway process (grpc.aio, the default model's tokenizer, auth off) on a private
redis-server. The requests are created and claimed in Redis as the scheduler and a verifier
would; a writer process then plays the verifiers: every `--step-ms` each of
streams / `--batch` verifiers, at its own phase in the step, commits one token to each of its
`--batch` requests with `RequestStore.commit_step` (one pipelined round trip, as a verifier's
step does), recording when it sent the commit, and after a request's last token ends it, as
a verifier does. One client process holds every stream open (grpc.aio,
`Generate(request_id, resume_from=0)`, 100 streams a channel; one that ends CANCELLED is
re-attached from its next index, as a client does) to its final chunk and records when each
token arrives. The delay of a token is its arrival less its commit's send time (one clock:
CLOCK_MONOTONIC); it includes the Redis write, the gateway, the network stack and the client.
The writer starts once the gateway has opened every stream (each has set its read cursor in
Redis). Also reported: the 99th percentile by second of the run; the delay the gateway adds,
from its own histogram (specserve_gateway_delivery_delay_seconds: from the entry's time in
Redis, whole milliseconds, to its handing the message to gRPC, so without the send and the
client's share); the gateway's garbage collections while streaming, by generation, with
the time they paused it; its threads and resident memory with no stream open, with all of
them open and after; and tokens per second delivered.
Writes <out>/scale_<streams>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import yaml

from benchmarks import write_results
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster, without_security
from specserve.v1 import generation_pb2, generation_pb2_grpc

VID = "bench-verifier"


def proc_status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Threads", "VmRSS"):
            fields[name] = int(value.split()[0])
    return {"threads": fields["Threads"], "rss_mib": round(fields["VmRSS"] / 1024, 1)}


def gateway_metrics(port: int) -> tuple[list[tuple[float, float]], dict[str, list[float]]]:
    """From the gateway's metrics: specserve_gateway_delivery_delay_seconds as (upper bound
    in s, count) pairs, and per garbage-collector generation [collections, seconds paused,
    collections that paused over 10 ms] (specserve_gc_pause_seconds)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    pattern = r'^specserve_gateway_delivery_delay_seconds_bucket\{le="([^"]+)"\} (\S+)$'
    buckets = [(float(m.group(1)), float(m.group(2))) for m in re.finditer(pattern, text, re.M)]
    gc = {}
    for g in "012":
        series = f'specserve_gc_pause_seconds_%s{{generation="{g}"%s}} (\\S+)$'
        count, total, short = (
            float(re.search("^" + series % (kind, le), text, re.M).group(1))
            for kind, le in (("count", ""), ("sum", ""), ("bucket", ',le="0.01"'))
        )
        gc[g] = [count, total, count - short]
    return buckets, gc


def gc_while(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict:
    return {
        f"generation_{g}": {
            "collections": int(after[g][0] - before[g][0]),
            "paused_ms": round(1000 * (after[g][1] - before[g][1]), 1),
            "over_10_ms": int(after[g][2] - before[g][2]),
        }
        for g in after
    }


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket the q-quantile falls in (a histogram's resolution)."""
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= q * total)


def writer(url: str, rids: list[str], args, start_at: float, out) -> None:
    """The verifiers: each commits one token to each of its requests once a step."""
    store = RequestStore.from_url(url)
    groups = [rids[i : i + args.batch] for i in range(0, len(rids), args.batch)]
    step = args.step_ms / 1000
    sent: dict[str, list[float]] = {rid: [] for rid in rids}
    index = {rid: 0 for rid in rids}
    end = start_at + args.seconds
    k = 0
    while True:
        base = start_at + k * step
        if base >= end:
            break
        for g, group in enumerate(groups):
            at = base + step * g / len(groups)  # each verifier at its own phase
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            now = time.monotonic()
            store.commit_step(VID, [(rid, index[rid], [11 + index[rid] % 1000]) for rid in group])
            for rid in group:
                sent[rid].append(now)
                index[rid] += 1
                if index[rid] == args.expected:  # its last token: it ends, as a verifier ends it
                    final = {
                        "finish_reason": "FINISH_REASON_LENGTH",
                        "usage": {"prompt_tokens": 3, "completion_tokens": args.expected},
                    }
                    store.finish(rid, VID, "finished", final, "batch")
        k += 1
    out.put(sent)


async def client(address: str, rids: list[str], args, out) -> None:
    channels = [grpc.aio.insecure_channel(address) for _ in range(0, len(rids), 100)]
    arrived: dict[str, list[float]] = {rid: [] for rid in rids}
    opened = 0

    reopened = [0]

    async def one(i: int, rid: str) -> None:
        nonlocal opened
        stub = generation_pb2_grpc.GenerationServiceStub(channels[i // 100])
        counted = False
        while True:  # a stream that breaks is re-attached from its next index, as clients do
            req = generation_pb2.GenerateRequest(request_id=rid, resume_from=len(arrived[rid]))
            call = stub.Generate(req, timeout=args.seconds + 120)
            if not counted:
                opened, counted = opened + 1, True
            try:
                async for chunk in call:  # (to the final chunk the request's end sends)
                    now = time.monotonic()
                    arrived[rid].extend([now] * len(chunk.token_ids))
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    raise
                reopened[0] += 1

    tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(rids)]
    while opened < len(rids):
        await asyncio.sleep(0.05)
    out.put("open")
    done, pending = await asyncio.wait(tasks, timeout=args.seconds + 60)
    for t in pending:
        t.cancel()
    errors = [repr(t.exception()) for t in done if t.exception()]
    out.put((arrived, errors[:5], len(pending), reopened[0]))


def run_client(address, rids, args, out) -> None:
    asyncio.run(client(address, rids, args, out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=20.0, help="how long tokens are written")
    p.add_argument("--step-ms", type=float, default=200.0, help="a verifier's step")
    p.add_argument("--batch", type=int, default=64, help="requests per verifier")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    steps = int(args.seconds * 1000 // args.step_ms)
    args.expected = steps
    with tempfile.TemporaryDirectory() as tmp:
        config = without_security({"gateway": {"log_level": "WARNING", "metrics_port": 0}})
        cluster = LocalCluster(config, Path(tmp))
        cluster.start_redis()
        store = RequestStore.from_url(cluster.redis_url)
        store.ensure_queues()
        rids = [f"scale-{i}" for i in range(args.streams)]
        for rid in rids:  # created and claimed, as the scheduler and a verifier do
            spec = {"request_id": rid, "prompt_ids": [1, 2, 3], "max_tokens": steps + 1}
            store.create(rid, spec, "batch", 10**9)
            store.claim(rid, VID, int(time.time() * 1000))
        cluster.config["common"]["redis_url"] = cluster.redis_url
        cluster.config_path.write_text(yaml.safe_dump(cluster.config))
        try:
            gateway = cluster.start_service("gateway")  # (it calls no scheduler here)
            cluster.wait_ready("gateway", 300)
            idle = proc_status(gateway.popen.pid)
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            clients = ctx.Process(target=run_client, args=(gateway.address, rids, args, results))
            clients.start()
            assert results.get(timeout=300) == "open"
            # Every stream is open at the gateway once it has set its read cursor.
            deadline = time.monotonic() + 300
            while not all(store.r.hexists(store.layout.req(rid), "read") for rid in rids):
                assert time.monotonic() < deadline, "the gateway did not open every stream"
                time.sleep(0.2)
            loaded = proc_status(gateway.popen.pid)
            _, gc_before = gateway_metrics(gateway.metrics_port)
            start_at = time.monotonic() + 0.5
            sent_q = ctx.Queue()
            writers = ctx.Process(
                target=writer, args=(cluster.redis_url, rids, args, start_at, sent_q)
            )
            writers.start()
            sent = sent_q.get(timeout=args.seconds + 300)
            arrived, errors, unfinished, reopened = results.get(timeout=args.seconds + 300)
            writers.join()
            clients.join()
            streaming = proc_status(gateway.popen.pid)
            delivery, gc_after = gateway_metrics(gateway.metrics_port)
        finally:
            cluster.stop()
    delays = sorted(
        1000 * (a - s) for rid in rids for s, a in zip(sent[rid], arrived[rid], strict=False)
    )
    got = sum(len(v) for v in arrived.values())
    by_second: dict[int, list[float]] = {}
    for rid in rids:
        for s, a in zip(sent[rid], arrived[rid], strict=False):
            by_second.setdefault(int(s - start_at), []).append(1000 * (a - s))
    p99_by_second = [round(sorted(v)[int(0.99 * len(v))], 1) for _, v in sorted(by_second.items())]

    def pct(q: float) -> float:
        return round(delays[min(len(delays) - 1, int(q * len(delays)))], 2)

    report = {
        "command": f"python -m benchmarks.scale --streams {args.streams} --seconds "
        f"{args.seconds:g} --step-ms {args.step_ms:g} --batch {args.batch}",
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "configuration": "one gateway process (grpc.aio), the default model's tokenizer, auth "
        "off, private redis-server without persistence, all on this machine (2 cores); "
        f"{args.streams} streams from one client process; writer: "
        f"{-(-args.streams // args.batch)} verifiers of {args.batch} requests, one token "
        f"per request every {args.step_ms:g} ms",
        "streams": args.streams,
        "tokens_written": sum(len(v) for v in sent.values()),
        "tokens_received": got,
        "tokens_per_second": round(got / args.seconds, 1),
        "streams_unfinished": unfinished,
        "streams_reattached": reopened,  # ended CANCELLED before their last token
        "client_errors": errors,
        "delay_ms": {
            "p50": pct(0.50),
            "p90": pct(0.90),
            "p99": pct(0.99),
            "max": round(delays[-1], 2) if delays else None,
            "mean": round(statistics.mean(delays), 2) if delays else None,
        },
        "delay_ms_p99_by_second": p99_by_second,
        # What the gateway adds: commit (the entry's time in Redis) to its message for gRPC,
        # from its own histogram; a bucket's upper bound, as the histogram resolves it.
        "gateway_delivery_ms": {
            q: round(1000 * bucket_quantile(delivery, p), 1)
            for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "gateway_delivery_histogram": [[bound, int(count)] for bound, count in delivery],
        "gateway_gc_while_streaming": gc_while(gc_before, gc_after),
        "gateway_process": {"idle": idle, "streams_open": loaded, "after_streaming": streaming},
    }
    write_results(report, args.out, f"scale_{args.streams}")


if __name__ == "__main__":
    main()
