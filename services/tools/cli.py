"""The `specserve` command: serve one service, start the local cluster, generate, manage models."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ..common.pools import CANARY
from ..common.settings import ConfigError, ServiceSettings
from .plan import PRESETS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SERVICES = ("gateway", "scheduler", "verifier", "drafter")


def _models(args: argparse.Namespace) -> int:
    from ..engine import models

    cache = args.cache_dir or ServiceSettings.load(args.config).model_cache_dir
    if args.models_cmd == "list":
        rows = models.list_models(cache)
        print(f"{'MODEL':40} {'STATE':12} SHA256")
        for r in rows:
            print(f"{r['name'] + '@' + r['version']:40} {r['state']:12} {r['sha256'][:16]}")
        return 0
    refs = [ref.partition("@")[::2] for ref in args.models] or list(models.DEFAULT_MODELS)
    if bad := next((name for name, version in refs if not version), None):
        print(f"error: name models as NAME@VERSION, got {bad!r}", file=sys.stderr)
        return 2
    if args.models_cmd == "wait":
        missing = models.wait_fetched(refs, cache, args.timeout)
        if missing:
            print(
                f"error: {', '.join(missing)} not in {cache} after {args.timeout:g} s; whoever "
                "fills it (the models Job on Kubernetes: `kubectl -n specserve logs job/models`) "
                "has not finished",
                file=sys.stderr,
            )
            return 1
        print(f"{', '.join(f'{n}@{v}' for n, v in refs)}: verified, in {cache}")
        return 0
    for name, version in refs:
        path = models.fetch(name, version, cache, force=args.force)
        print(f"{name}@{version}: verified, at {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ..common.service import run_service

    return run_service(args.service, args.config, port=args.port)


def _up(args: argparse.Namespace) -> int:
    from .local_cluster import run_local_cluster
    from .supervisor import RestartPolicy

    policy = RestartPolicy(max_restarts=args.max_restarts)
    return run_local_cluster(args.config, redis_url=args.redis_url, port=args.port, policy=policy)


def _generate(args: argparse.Namespace) -> int:
    from .client import generate_to_terminal

    return generate_to_terminal(args)


def _keys(args: argparse.Namespace) -> int:
    from ..common.settings import GatewaySettings
    from ..gateway.keys import KeyStore
    from ..store import RequestStore

    settings = GatewaySettings.load(args.config)
    keys = KeyStore(RequestStore.connect(settings, args.redis_url))
    if args.keys_cmd == "create":
        if args.tier not in settings.tiers:
            print(f"error: unknown tier {args.tier!r} (known: {sorted(settings.tiers)})")
            return 2
        limits = settings.tiers[args.tier].model_copy(
            update={
                k: v
                for k, v in {
                    "requests_per_minute": args.rpm,
                    "tokens_per_minute": args.tpm,
                    "concurrent_streams": args.streams,
                }.items()
                if v is not None
            }
        )
        key = keys.create(args.tenant, args.tier, limits)
        print(key)
        print(
            f"(tenant {args.tenant}, tier {args.tier}; shown once: only its hash is kept)",
            file=sys.stderr,
        )
    elif args.keys_cmd == "list":
        print(f"{'ID':14} {'TENANT':20} {'TIER':10} {'RPM':>6} {'TPM':>9} {'STREAMS':>7}  STATE")
        for k in keys.list():
            state = "revoked" if k.get("revoked") == "1" else "active"
            print(
                f"{k['id']:14} {k['tenant']:20} {k['tier']:10} {k['requests_per_minute']:>6} "
                f"{k['tokens_per_minute']:>9} {k['concurrent_streams']:>7}  {state}"
            )
    elif not keys.revoke(args.key_id):
        print(f"error: no key with id {args.key_id!r} (see `specserve keys list`)")
        return 1
    else:
        print(f"revoked {args.key_id}")
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 if the service on this host answers SERVING (the k8s probe: TLS-aware, which
    the kubelet's own gRPC probe is not)."""
    from ..common import tls
    from ..common.settings import SETTINGS_BY_SERVICE
    from .doctor import health

    settings = SETTINGS_BY_SERVICE[args.service].load(args.config)
    tls.configure(settings)
    finding = health(args.service, f"127.0.0.1:{args.port or settings.port}", args.timeout)
    print(finding.line())
    return 0 if finding.level == "ok" else 1


def _plan(args: argparse.Namespace) -> int:
    from ..common.settings import ModelRef
    from ..engine import models
    from . import plan

    cache = ServiceSettings.load(args.config).model_cache_dir

    def shape(ref: str | None):
        if ref is None:
            return None
        if Path(ref).is_dir():
            return plan.shape_from_dir(Path(ref))
        name, _, version = ref.partition("@")
        path, _ = models.resolve(ModelRef(name=name, version=version), cache)
        return plan.shape_from_dir(path)

    if args.device == "this-machine":
        device = plan.measure_this_machine(dtype=args.dtype)
    else:
        device = plan.PRESETS[args.device]
    acceptance, source = 0.7, "assumed"
    if args.acceptance is not None:
        acceptance, source = args.acceptance, "given"
    elif args.metrics_url:
        acceptance, source = plan.measured_acceptance(args.metrics_url), "measured"
    load = plan.Load(
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        dtype=args.dtype,
        acceptance=acceptance,
        acceptance_source=source,
        target_tokens_per_s=args.target_tokens_per_s,
        target_ttft_s=args.target_ttft_ms / 1000,
        tensor_parallel=args.tensor_parallel,
    )
    result = plan.plan(shape(args.model), shape(args.draft), device, load)
    print(plan.render(result))
    if args.out:
        Path(args.out).write_text(plan.as_json(result))
        print(f"written to {args.out}", file=sys.stderr)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import run

    return run(args.config, {"gateway": args.gateway, "scheduler": args.scheduler})


def _rollout(args: argparse.Namespace) -> int:
    import grpc

    from ..common import tls
    from ..common.settings import GatewaySettings
    from ..engine import models
    from ..store import RequestStore
    from ..v1 import scheduler_pb2_grpc
    from . import rollout

    settings = GatewaySettings.load(args.config)
    store = RequestStore.connect(settings, args.redis_url)
    if not store.ping():
        print("error: Redis is unreachable (check redis_url; `specserve doctor`)", file=sys.stderr)
        return 1
    if args.rollout_cmd == "status":
        report = rollout.status(store)
        print(json.dumps(report, indent=2) if args.json else rollout.render_status(report))
    elif args.rollout_cmd == "canary":
        old = store.set_canary_share(args.share)
        print(f"canary share {old:.0%} -> {args.share:.0%} of new requests")
        if CANARY not in rollout.pools(store):
            print("note: no canary verifier is live yet; the share applies once one is")
    elif args.rollout_cmd == "rollback":
        return rollout.rollback(store, args.wait)
    else:
        tls.configure(settings)
        path, _ = models.resolve(settings.model, settings.model_cache_dir)
        tokenizer = models.load_tokenizer(path)
        address = args.scheduler or settings.scheduler_address
        try:
            with tls.channel(address, peer="scheduler") as channel:
                results = rollout.probe(
                    store,
                    scheduler_pb2_grpc.SchedulerServiceStub(channel),
                    tokenizer.encode,
                    max_tokens=args.max_tokens,
                )
        except grpc.RpcError as e:
            print(
                f"error: the scheduler at {address}: {e.code().name} {e.details()}", file=sys.stderr
            )
            return 1
        except (RuntimeError, TimeoutError) as e:  # no such pool; a probe failed or hung
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(rollout.render_probe(results))
        if args.out:
            Path(args.out).write_text(rollout.probe_json(results))
        exact = rollout.agreement(results)["exact"]
        if args.min_agreement is not None and exact < args.min_agreement:
            print(f"agreement {exact:.0%} is below {args.min_agreement:.0%}", file=sys.stderr)
            return 1
    return 0


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share is within 0 and 1, got {text}")
    return value


def _redis_users(args: argparse.Namespace) -> int:
    from ..store.acl import make_users

    out = Path(args.out)
    make_users(out, args.host)
    for name in sorted(p.name for p in out.iterdir()):
        print(out / name)
    print(
        "redis.conf: a user per service (only its keys, no operator commands) and the "
        "operator's (default); include it in Redis's config. url-<service>: the redis_url "
        "of each service; url: the operator's. Files are mode 0600.",
        file=sys.stderr,
    )
    return 0


def _certs(args: argparse.Namespace) -> int:
    from ..common.tls import make_dev_certs

    paths = make_dev_certs(Path(args.out), days=args.days)
    for what, path in paths.items():
        print(f"{what:14} {path}")
    print(
        "a development CA and a certificate per service; keys are mode 0600. Point each "
        "service's tls_ca_file, tls_cert_file and tls_key_file at them.",
        file=sys.stderr,
    )
    return 0


GENERATE_EPILOG = """\
The same over the other ways in (`specserve up` prints these with its dev key and CA):
  gRPC, with grpcurl:
    grpcurl -cacert ca.pem -H "authorization: Bearer $KEY" \\
      -d '{"prompt": "def fib(n):", "max_tokens": 32}' \\
      127.0.0.1:50051 specserve.v1.GenerationService/Generate
  HTTP, with the openai package (the gateway's http_port, 8000 in config/specserve.yaml):
    from openai import OpenAI
    client = OpenAI(base_url="https://127.0.0.1:8000/v1", api_key=KEY)
    for chunk in client.chat.completions.create(
        model="qwen2.5-coder-1.5b-instruct", stream=True,
        messages=[{"role": "user", "content": "def fib(n):"}]):
        print(chunk.choices[0].delta.content or "", end="")
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve",
        description="Speculative-decoding LLM inference service.",
        epilog="Quick start: `specserve models fetch`, then `specserve up`, then "
        '`specserve generate "Write a haiku about Redis"` in another terminal.',
    )
    p.add_argument(
        "--config",
        help="YAML config file (sections: common, gateway, scheduler, "
        "verifier, drafter); env SPECSERVE_<SERVICE>_<KEY> overrides it",
        default=os.environ.get("SPECSERVE_CONFIG"),
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run one service in the foreground")
    s.add_argument("service", choices=SERVICES)
    s.add_argument("--port", type=int, help="listen port (overrides config)")
    s.set_defaults(func=_serve)

    u = sub.add_parser("up", help="start the whole local cluster (Redis + four services)")
    u.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    u.add_argument("--port", type=int, default=50051, help="gateway port (default 50051)")
    u.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts (with backoff) of a member that keeps dying within 60s of its start "
        "before the cluster stops (default 5)",
    )
    u.set_defaults(func=_up)

    g = sub.add_parser(
        "generate",
        help="stream a completion from a running gateway",
        description="Streams a completion from a running gateway over gRPC.",
        epilog=GENERATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("prompt", help="prompt text (sent as a chat message unless --raw)")
    g.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    g.add_argument("--batch", action="store_true", help="use the batch priority class")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    g.add_argument(
        "--ca",
        default=os.environ.get("SPECSERVE_CA"),
        help="CA certificate to check the gateway's TLS certificate with (default: env "
        "SPECSERVE_CA); without it, plaintext (with --api-key: only with --insecure)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext even with --api-key: anyone on the path reads the key (development "
        "clusters started without TLS only)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("SPECSERVE_API_KEY"),
        help="API key (default: env SPECSERVE_API_KEY; `specserve up` prints a dev key)",
    )
    g.set_defaults(func=_generate)

    k = sub.add_parser("keys", help="create, list and revoke API keys (stored hashed in Redis)")
    k.add_argument("--redis-url", help="Redis holding the keys (default from config)")
    ksub = k.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", help="create a key for a tenant; prints it once")
    kc.add_argument("--tenant", required=True, help="tenant name (a-z, 0-9, -)")
    kc.add_argument("--tier", default="standard", help="tier from the gateway config's `tiers`")
    kc.add_argument("--rpm", type=int, help="requests per minute (default: the tier's)")
    kc.add_argument("--tpm", type=int, help="tokens per minute (default: the tier's)")
    kc.add_argument("--streams", type=int, help="concurrent streams (default: the tier's)")
    ksub.add_parser("list", help="list keys (ids, tenants, limits; never the keys)")
    kr = ksub.add_parser("revoke", help="revoke a key by its id")
    kr.add_argument("key_id", help="the id: the part after ssk_ in the key")
    k.set_defaults(func=_keys)

    pl = sub.add_parser("plan", help="estimate the hardware a load needs (memory, replicas, speed)")
    pl.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct@0.2.0", help="NAME@VERSION or a model dir"
    )
    pl.add_argument(
        "--draft", default="qwen2.5-coder-0.5b-instruct@0.9.0", help="NAME@VERSION or a dir"
    )
    pl.add_argument(
        "--device",
        default="this-machine",
        choices=["this-machine", *sorted(PRESETS)],
        help="a preset, or this machine (its RAM, and its memory bandwidth measured now)",
    )
    pl.add_argument("--concurrency", type=int, default=8, help="streams at once")
    pl.add_argument("--prompt-tokens", type=int, default=512)
    pl.add_argument("--output-tokens", type=int, default=256)
    pl.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "int8", "int4"]
    )
    pl.add_argument("--acceptance", type=float, help="per draft token (default: assumed 0.7)")
    pl.add_argument(
        "--metrics-url", help="a running verifier's /metrics: its measured acceptance is used"
    )
    pl.add_argument("--target-tokens-per-s", type=float, default=0.0, help="per stream; 0: none")
    pl.add_argument("--target-ttft-ms", type=float, default=0.0, help="0: none")
    pl.add_argument(
        "--tensor-parallel",
        type=int,
        default=0,
        help="devices each verifier spans (verifier.tensor_parallel); 0: the fewest that "
        "hold the target's weights",
    )
    pl.add_argument("--out", help="also write the plan as JSON here")
    pl.set_defaults(func=_plan)

    d = sub.add_parser(
        "doctor", help="check this machine and the cluster its config names (exit 1 on a fail)"
    )
    d.add_argument("--gateway", help="gateway host:port (default: this host, config port)")
    d.add_argument("--scheduler", help="scheduler host:port (default: the gateway's config)")
    d.set_defaults(func=_doctor)

    h = sub.add_parser("health", help="check a service on this host (exit 0 if SERVING)")
    h.add_argument("service", choices=SERVICES)
    h.add_argument("--port", type=int, help="its port (default from config)")
    h.add_argument("--timeout", type=float, default=3.0)
    h.set_defaults(func=_health)

    r = sub.add_parser(
        "rollout",
        help="canary rollout: status, share, greedy probes, rollback",
        description="Two verifier pools (config key `pool`: stable, canary) behind one "
        "scheduler. The canary gets the share set here (live, for every scheduler); a "
        "request finishes on the model version it started on.",
    )
    r.add_argument("--redis-url", help="default from config")
    rsub = r.add_subparsers(dest="rollout_cmd", required=True)
    rs = rsub.add_parser("status", help="pools, their versions and configs, the share")
    rs.add_argument("--json", action="store_true")
    rc = rsub.add_parser("canary", help="set the share of new requests the canary pool gets")
    rc.add_argument("share", type=_share, help="0 to 1 (0.1: one request in ten; 1: promote)")
    rr = rsub.add_parser(
        "rollback", help="share 0: new requests go to stable; running ones finish on canary"
    )
    rr.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="wait up to this many seconds for the canary pool to run nothing "
        "(exit 1 if it does not)",
    )
    rp = rsub.add_parser("probe", help="greedy outputs of both pools on a fixed prompt set")
    rp.add_argument("--scheduler", help="scheduler host:port (default: the gateway's config)")
    rp.add_argument("--max-tokens", type=int, default=16)
    rp.add_argument("--out", help="also write the outputs and agreement as JSON here")
    rp.add_argument(
        "--min-agreement", type=_share, help="exit 1 if fewer probes than this agree exactly"
    )
    r.set_defaults(func=_rollout)

    c = sub.add_parser("certs", help="make TLS certificates")
    csub = c.add_subparsers(dest="certs_cmd", required=True)
    cd = csub.add_parser("dev", help="a development CA and a certificate per service")
    cd.add_argument("--out", required=True, help="directory to write the PEM files to")
    cd.add_argument("--days", type=int, default=365, help="validity (default 365)")
    c.set_defaults(func=_certs)

    ru = sub.add_parser("redis-users", help="a Redis user per service, with a password each")
    ru.add_argument("--out", required=True, help="directory to write redis.conf and the URLs to")
    ru.add_argument(
        "--host", default="redis:6379", help="host:port the services reach Redis at (redis:6379)"
    )
    ru.set_defaults(func=_redis_users)

    m = sub.add_parser("models", help="fetch and list models")
    m.add_argument("--cache-dir", help="model cache directory (default from config)")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    f = msub.add_parser("fetch", help="download, verify (sha256) and convert models")
    f.add_argument("models", nargs="*", help="NAME@VERSION (default: the default pair)")
    f.add_argument("--force", action="store_true", help="fetch again even if verified")
    msub.add_parser("list", help="show catalog models and whether they are fetched")
    w = msub.add_parser(
        "wait",
        help="wait until models are fetched into the cache by someone else (an init "
        "container's wait for the Kubernetes models Job); fetches nothing",
    )
    w.add_argument("models", nargs="*", help="NAME@VERSION (default: the default pair)")
    w.add_argument(
        "--timeout", type=float, default=3600, help="seconds to wait before failing (3600)"
    )
    m.set_defaults(func=_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the CLI's last line of defence: a message, not a traceback
        from ..engine.models import ModelError

        if isinstance(e, ModelError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
