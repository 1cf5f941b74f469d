"""`specserve doctor`: is this machine, and the cluster its config names, ready to serve?

Each check prints one line, ok / warn / fail, with what to do about anything not ok. The exit
code is 1 if any check failed.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..common import tls
from ..common.settings import SETTINGS_BY_SERVICE, ConfigError, ServiceSettings
from ..engine import models
from ..store import RequestStore
from ..store.ownership import Orphan, OrphanFinder

PACKAGES = ("torch", "transformers", "grpcio", "redis", "protobuf", "opentelemetry-sdk")
CERT_WARN_DAYS = 30


@dataclass
class Finding:
    level: str  # ok | warn | fail
    check: str
    detail: str

    def line(self) -> str:
        return f"{self.level:4}  {self.check:28} {self.detail}"


def run(
    config_path: str | None,
    addresses: dict[str, str] | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Prints every finding; 1 if any failed. `addresses` overrides where the gateway and the
    scheduler are dialled (verifiers and drafters are found in the registry)."""
    findings = []
    for finding in checks(config_path, addresses or {}):
        findings.append(finding)
        out(finding.line())
    failed = sum(f.level == "fail" for f in findings)
    warned = sum(f.level == "warn" for f in findings)
    out(f"\n{len(findings)} checks: {failed} failed, {warned} warnings")
    return 1 if failed else 0


def checks(config_path: str | None, addresses: dict[str, str]) -> Iterator[Finding]:
    yield Finding("ok", "python", sys.version.split()[0])
    for package in PACKAGES:
        try:
            yield Finding("ok", f"package {package}", importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            yield Finding("fail", f"package {package}", "missing: run `make install`")
    try:
        settings = {name: cls.load(config_path) for name, cls in SETTINGS_BY_SERVICE.items()}
    except ConfigError as e:
        yield Finding("fail", "config", f"{e}")
        return
    yield Finding("ok", "config", f"{config_path or 'defaults'}: every service's settings load")
    yield from accelerators(settings["verifier"])
    yield from model_files(settings)
    yield from certificates(settings)
    yield from cluster(settings, addresses)


def accelerators(verifier) -> Iterator[Finding]:
    import torch

    if not torch.cuda.is_available():
        # A verifier set to cuda here already failed the config check (settings refuse it).
        yield Finding(
            "ok", "accelerators", f"none visible (the verifier runs on {verifier.device})"
        )
        return
    count = torch.cuda.device_count()
    for i in range(count):
        free, total = torch.cuda.mem_get_info(i)
        name = torch.cuda.get_device_name(i)
        yield Finding("ok", f"gpu {i}", f"{name}, {free / 1e9:.1f} of {total / 1e9:.1f} GB free")
    if count > 1:
        peers = all(
            torch.cuda.can_device_access_peer(i, j)
            for i in range(count)
            for j in range(count)
            if i != j
        )
        yield Finding(
            "ok" if peers else "warn",
            "gpu peer access",
            "all pairs"
            if peers
            else "some pairs cannot reach each other directly (slower multi-GPU)",
        )


def free_memory_bytes(device: str) -> float:
    """Free memory of the verifier's device (0 if it cannot be read)."""
    import torch

    from ..verifier.admission import free_memory_bytes as free

    try:
        return float(free(torch.device(device)))
    except RuntimeError:
        return 0.0


def model_files(settings: dict[str, ServiceSettings]) -> Iterator[Finding]:
    from .plan import DTYPE_BYTES, shape_from_dir

    verifier, drafter = settings["verifier"], settings["drafter"]
    wanted = [("target", verifier.model, verifier.dtype)]
    if drafter.proposer in ("draft_model", "hybrid") and not drafter.draft_model_path:
        wanted.append(("draft", drafter.draft_model, drafter.dtype))
    need = 0.0
    for role, ref, dtype in wanted:
        try:
            path, manifest = models.resolve(ref, verifier.model_cache_dir)
        except models.ModelError as e:
            yield Finding("fail", f"{role} model", f"{e}")
            continue
        sha = manifest.get("sha256", "")[:16]
        yield Finding("ok", f"{role} model", f"{ref.label} at {path} (sha256 {sha}...)")
        weights = shape_from_dir(path).params * DTYPE_BYTES.get(dtype, 2)
        if role == "target" and verifier.tensor_parallel > 1:
            yield tensor_parallel(verifier, path)
            if verifier.device != "cpu":  # (on the CPU the ranks share its memory)
                weights /= verifier.tensor_parallel
        need += weights
    if need:
        free = free_memory_bytes(verifier.device)
        level = "ok" if free > 1.2 * need else "warn" if free > need else "fail"
        fix = "" if level == "ok" else ": lower dtype, or run the drafter elsewhere"
        yield Finding(
            level,
            "memory for the models",
            f"{need / 1e9:.1f} GB of weights, {free / 1e9:.1f} GB free on {verifier.device}{fix}",
        )


def tensor_parallel(verifier, path: Path) -> Finding:
    """Whether the target splits over verifier.tensor_parallel ranks, and the exchange
    between them is built in (NCCL on CUDA, gloo on the CPU). Enough devices for the ranks
    is checked with the config (the settings refuse too few)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from ..engine.tensor_parallel import ShardError, shard_config

    n = verifier.tensor_parallel
    backend = "gloo" if verifier.device == "cpu" else "nccl"
    built = dist.is_available() and (
        dist.is_gloo_available() if backend == "gloo" else dist.is_nccl_available()
    )
    if not built:
        return Finding("fail", "tensor parallel", f"this torch has no {backend}: no ranks can meet")
    try:
        shard_config(AutoConfig.from_pretrained(str(path)), n)
    except ShardError as e:
        return Finding("fail", "tensor parallel", str(e))
    return Finding("ok", "tensor parallel", f"the target splits over {n} ranks ({backend})")


def certificates(settings: dict[str, ServiceSettings]) -> Iterator[Finding]:
    from cryptography import x509

    seen = set()
    for name, s in settings.items():
        if s.insecure:
            yield Finding("warn", f"tls {name}", "insecure: true (plaintext): development only")
            continue
        if not (s.tls_ca_file and s.tls_cert_file and s.tls_key_file):
            fix = "set tls_ca_file, tls_cert_file and tls_key_file, or insecure: true (dev)"
            yield Finding("fail", f"tls {name}", f"no certificates: {fix}")
            continue
        for path in (s.tls_ca_file, s.tls_cert_file):
            if not path or path in seen:
                continue
            seen.add(path)
            if not Path(path).exists():  # (a pod holds its own service's certificate only)
                yield Finding(
                    "ok", f"tls {name}", f"{path} is not on this host: checked where it is"
                )
                continue
            try:
                cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
            except (OSError, ValueError) as e:
                yield Finding("fail", f"tls {name}", f"cannot read {path}: {e}")
                continue
            left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
            level = "fail" if left.days < 0 else "warn" if left.days < CERT_WARN_DAYS else "ok"
            yield Finding(
                level,
                f"certificate {Path(path).name}",
                f"expires in {left.days} days"
                + ("" if level == "ok" else ": renew it (specserve certs dev for dev)"),
            )


def cluster(settings: dict[str, ServiceSettings], addresses: dict[str, str]) -> Iterator[Finding]:
    common = settings["scheduler"]
    store = RequestStore.connect(common)
    if not store.ping():
        yield Finding("fail", "redis", "unreachable: start it, or fix redis_url")
        return
    aof = store.appendonly()  # ("?" where CONFIG is disabled)
    level = "ok" if aof == "yes" else "warn"
    yield Finding(
        level,
        "redis",
        f"reachable; appendonly={aof}"
        + ("" if aof == "yes" else ": without AOF a Redis restart loses every request"),
    )
    skew = store.server_time() - time.time()
    level = "ok" if abs(skew) < 1 else "warn"
    yield Finding(
        level,
        "clock skew to redis",
        f"{skew * 1000:+.0f} ms"
        + ("" if level == "ok" else ": deadlines need synchronised clocks (NTP)"),
    )
    gateway, scheduler = settings["gateway"], settings["scheduler"]
    targets = [
        ("gateway", addresses.get("gateway") or f"127.0.0.1:{gateway.port}"),
        ("scheduler", addresses.get("scheduler") or gateway.scheduler_address),
    ]
    verifiers = store.live("verifier")
    targets += [(f"verifier {v['id']}", v["address"]) for v in verifiers]
    targets += [(f"drafter {d['id']}", d["address"]) for d in store.live("drafter")]
    # Dial with the certificate of whichever service this host holds (each is the cluster CA's).
    mine = next(
        (s for s in settings.values() if s.insecure or Path(s.tls_cert_file or "").is_file()),
        scheduler,
    )
    try:
        tls.configure(mine)
    except ConfigError as e:
        yield Finding("fail", "health", f"cannot dial the services: {e}")
        return
    for name, address in targets:
        yield health(name, address)
    if not verifiers:
        yield Finding("fail", "verifiers", "none registered: nothing can be generated")
    heartbeat = settings["verifier"].heartbeat_seconds
    yield orphans_finding(store, scheduler.orphan_grace_seconds, heartbeat)
    yield rollout_finding(verifiers, store.rollout()["canary_share"])


def orphans_finding(store: RequestStore, grace_seconds: float, period_seconds: float) -> Finding:
    """Requests Redis records as running on a live verifier that does not run them
    (store/ownership.py, the scheduler's rule); one missing from a verifier's list is looked
    at again in its next lists (a few heartbeats at most)."""
    finder = OrphanFinder(int(grace_seconds * 1000))
    found: dict[str, Orphan] = {}
    for attempt in range(4):
        if attempt:
            time.sleep(period_seconds)
        claims = store.claims(store.owners())
        live = {v["id"]: v for v in store.live("verifier")}
        found |= {o.claim.request_id: o for o in finder.look(claims, live)}
        if not finder.suspects:
            break
    if not found:
        return Finding("ok", "orphaned requests", f"none ({len(claims)} running)")
    named = "; ".join(f"{rid} ({o.detail})" for rid, o in sorted(found.items()))
    return Finding(
        "fail",
        "orphaned requests",
        f"{len(found)} running where their verifier does not run them: {named}. The scheduler "
        "requeues them within seconds; if they stay, check that a scheduler is running",
    )


def rollout_finding(verifiers: list[dict], canary_share: float) -> Finding:
    """Which versions serve which share; a warning where a pool serves several versions or
    the share names a pool with no live verifier (its requests wait)."""
    from ..common import pools

    versions = {pool: pools.versions(m) for pool, m in pools.by_pool(verifiers).items()}
    shares = pools.pool_shares(set(versions), canary_share)
    detail = "; ".join(
        f"{pool} {shares.get(pool, 0):.0%}: {', '.join(vs)}" for pool, vs in versions.items()
    )
    mixed = [pool for pool, vs in versions.items() if len(vs) > 1]
    if mixed:
        return Finding(
            "warn",
            "rollout",
            f"{detail}: {', '.join(mixed)} serves several versions "
            "(mid-upgrade?); requests stay on the version they started on",
        )
    wanted = pools.CANARY if canary_share >= 1 else pools.STABLE if canary_share <= 0 else None
    if versions and wanted and wanted not in versions:
        return Finding(
            "warn",
            "rollout",
            f"canary share {canary_share:.0%} sends every new request to the {wanted} pool, "
            "which has no live verifier: they wait (`specserve rollout canary` to change it)",
        )
    return Finding("ok", "rollout", detail or "no verifier")


def health(name: str, address: str, timeout: float = 3.0) -> Finding:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with tls.channel(address, peer=name.split()[0]) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as e:
            return Finding("fail", f"health {name}", f"{address}: {e.code().name}")
        serving = status.status == health_pb2.HealthCheckResponse.SERVING
        state = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
        if serving and name.startswith("verifier"):
            state += serves(channel, timeout)
    return Finding(
        "ok" if serving else "fail",
        f"health {name}",
        f"{address}: {state}"
        + ("" if serving else ": see its log (Redis reachable? model loaded?)"),
    )


def serves(channel, timeout: float) -> str:
    """What a verifier serves, from its Status: pool, model version, sha256, config."""
    import grpc

    from ..v1 import verifier_pb2, verifier_pb2_grpc

    try:
        st = verifier_pb2_grpc.VerifierServiceStub(channel).Status(
            verifier_pb2.StatusRequest(), timeout=timeout
        )
    except grpc.RpcError as e:
        return f"; status: {e.code().name}"
    return f"; {st.pool} pool, {st.model_version} (sha256 {st.sha256[:16]}), config {st.config}"
