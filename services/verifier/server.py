"""Verifier gRPC service: Admit / Cancel / Status, and the registry heartbeat."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import struct
import threading
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from ..common import logprob_format, telemetry
from ..common.grpc_server import Server
from ..common.settings import ConfigError, VerifierSettings
from ..engine import models
from ..engine.flat_model import CompileFailed, FlatModel, UnsupportedAttention
from ..engine.tensor_parallel import ShardError, shard_config
from ..speculation import grammar
from ..speculation.grammar import Grammars
from ..speculation.sampling import SamplingParams
from ..store import RequestStore, heartbeat_forever, now_ms
from ..v1 import common_pb2
from ..v1 import verifier_pb2 as pb
from ..v1 import verifier_pb2_grpc as pb_grpc
from . import metrics
from .admission import Admission, Refused, kv_budget
from .constraint import Constraint, GrammarViolation
from .drafter_pool import registered_drafters
from .engine import Engine
from .ranks import Ranks
from .runner import ModelRunner
from .sequence import Sequence
from .speculator import Speculator
from .writes import Owner

log = logging.getLogger(__name__)


def sequence_from_record(rec, restored: list[int]) -> Sequence:
    """Builds the running sequence of a request from its Redis record and the tokens it
    generated before (on a verifier that died or drained): they are prefilled with the
    prompt, and generation goes on after them."""
    req = rec.request
    sampling, speculation = req.sampling, req.speculation
    return Sequence(
        request_id=rec.request_id,
        prompt_ids=list(req.prompt_ids),
        max_tokens=req.max_tokens,
        params=SamplingParams(
            temperature=as_written(sampling.temperature),
            top_p=as_written(sampling.top_p),
            top_k=sampling.top_k,
            seed=sampling.seed if sampling.HasField("seed") else None,
        ),
        stop=list(req.stop),
        speculate=speculation.mode != common_pb2.SPECULATION_MODE_OFF,
        tree_size=speculation.tree_size if speculation.HasField("tree_size") else None,
        session_id=req.session_id,
        tenant=req.tenant,
        prefix_scope=req.prefix_scope,  # (the gateway's choice)
        deadline_ms=req.deadline_unix_ms,
        output_ids=list(restored),
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        # (the restored tokens' entries are in the output stream already: never written again)
        output_logprobs=[logprob_format.UNKNOWN] * len(restored) if req.logprobs else [],
        num_emitted=len(restored),
        restored=len(restored),
        queue=rec.queue,
        entry_id=rec.entry_id,
        created_ms=rec.created_ms,
        admitted_ms=rec.admitted_ms,
    )


def as_written(value: float) -> float:
    """A proto float (32 bits) as the client wrote it (0.7, not 0.699999988...): the
    shortest decimal that is the same 32-bit float, as the proto's JSON mapping writes it."""
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == value:
            return short
    return value


def constrain(seq: Sequence, rec, grammars: Grammars, eos_ids: set[int]) -> None:
    """Gives a sequence its grammar's matcher, past the tokens it already has; one that
    cannot be built (the gateway compiled it: a version apart?) ends the request with why."""
    request = rec.request
    if request.grammar.WhichOneof("kind") is None:
        if rec.spec.get("grammar"):  # a kind this version does not know: never run unbound
            seq.finish_reason = "FINISH_REASON_ERROR"
            seq.error = "grammar: of a kind this verifier does not know (a newer gateway's?)"
        return  # (none, or an empty one: none asked)
    try:
        text = grammar.source(request.grammar)
        seq.constraint = Constraint(grammars.matcher(text), grammars.vocab_size, eos_ids)
        seq.grammar = text
        for token in seq.output_ids:
            seq.constraint.consume(token)
    except (grammar.GrammarError, GrammarViolation) as e:
        seq.constraint = None
        seq.finish_reason, seq.error = "FINISH_REASON_ERROR", f"grammar: {e}"


# Settings that name or place this process rather than shape what it serves.
PLACE_KEYS = {
    "host",
    "port",
    "verifier_id",
    "advertise_address",
    "redis_url",
    "metrics_port",
    "pool",
}


@dataclass(frozen=True)
class Served:
    """What this verifier serves; the registry, Status, metrics and every stream entry
    report it, and a request that generated tokens stays on its `version`."""

    pool: str
    model: str  # the configured model (name@version or path)
    version: str  # models.served_version: name, weights' sha256 prefix, dtype, device
    sha256: str
    config: str  # sha256 prefix of the settings, less PLACE_KEYS

    @classmethod
    def of(cls, settings: VerifierSettings, sha256: str, attention: str = "paged") -> Served:
        shape = settings.model_dump(mode="json", exclude=PLACE_KEYS)
        config = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()
        return cls(
            pool=settings.pool,
            model=settings.model.label,
            version=models.served_version(
                settings.model,
                sha256,
                dtype=settings.dtype,
                device=settings.device,
                attention=attention,
            ),
            sha256=sha256,
            config=config[:12],
        )


class VerifierService(pb_grpc.VerifierServiceServicer):
    def __init__(
        self,
        settings: VerifierSettings,
        engine: Engine,
        store: RequestStore,
        served: Served,
        grammars: Grammars,
    ):
        self.settings = settings
        self.engine = engine
        self.grammars = grammars
        self.store = store
        self.verifier_id = engine.writes.owner.verifier_id
        self.incarnation = engine.writes.owner.incarnation
        self.served = served
        self.draining = False  # set on SIGTERM: no new work

    def Admit(self, request: pb.AdmitRequest, context: grpc.ServicerContext) -> pb.AdmitResponse:
        parent = telemetry.extract(context.invocation_metadata())
        with telemetry.tracer.start_as_current_span("verifier.admit", context=parent) as span:
            response = self._admit(request, context)
            span.set_attribute("admitted", response.admitted)
            return response

    def _admit(self, request: pb.AdmitRequest, context) -> pb.AdmitResponse:
        rid = request.request_id
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        admission = self.engine.admission
        if admission.holds(rid):
            return self._held(rid)
        if self.draining:
            return pb.AdmitResponse(admitted=False, reason="the verifier is draining")
        if lost := self.engine.lifecycle.lost:
            reason = f"the verifier lost a tensor-parallel rank: {lost}"
            return pb.AdmitResponse(admitted=False, reason=reason)
        rec = self.store.get(rid)
        if rec is None or rec.status != "queued":
            return pb.AdmitResponse(admitted=False, reason="the request is not queued")
        seq = sequence_from_record(rec, self.store.progress(rid) if rec.generated else [])
        constrain(seq, rec, self.grammars, self.engine.eos_ids)
        try:
            grant = admission.admit(rid, seq.queue, seq.all_ids, seq.prefix_scope)
        except Refused as e:
            return pb.AdmitResponse(admitted=False, free_slots=self._free(), reason=str(e))
        if grant is None:  # a concurrent Admit of the same request (a retry) is admitting it
            return self._held(rid)
        seq.admitted_ms = now_ms()
        if trace.get_current_span().get_span_context().is_valid:  # traced (tracing is on)
            seq.trace_ctx = otel_context.get_current()
        try:
            claimed = self.store.claim(
                rid,
                self.verifier_id,
                seq.admitted_ms,
                self.served.version,
                self.served.pool,
                self.incarnation,
            )
        except Exception:
            grant.kv.free()
            admission.release(rid)
            raise
        if claimed != 1:
            grant.kv.free()
            admission.release(rid)
            reason = "the request is not queued"
            if claimed == 2:
                reason = f"the request started on model version {rec.version} and finishes there"
            return pb.AdmitResponse(admitted=False, reason=reason)
        try:
            self.engine.admit(seq, grant)
        except Exception:  # (claimed: the reaper requeues it, as it is not running here)
            grant.kv.free()
            admission.release(rid)
            raise
        log.info(
            "admitted",
            extra={
                "request_id": rid,
                "prompt_tokens": len(seq.prompt_ids),
                "restored_tokens": seq.restored,
                "kv_blocks": len(grant.kv.table),
                "cached_tokens": seq.cached_tokens,
            },
        )
        return pb.AdmitResponse(admitted=True, free_slots=self._free())

    def _held(self, rid: str) -> pb.AdmitResponse:
        """Admit of a request this verifier holds: a retry (admitted), unless the request was
        requeued while this verifier was thought dead and its old copy is still leaving."""
        rec = self.store.get(rid)
        ours = (self.verifier_id, self.incarnation, "running")
        if rec is not None and (rec.owner, rec.incarnation, rec.status) == ours:
            return pb.AdmitResponse(admitted=True, free_slots=self._free())
        return pb.AdmitResponse(
            admitted=False, reason="an earlier copy of the request is still leaving this verifier"
        )

    def Cancel(self, request, context) -> pb.VerifierServiceCancelResponse:
        return pb.VerifierServiceCancelResponse(found=self.engine.cancel(request.request_id))

    def Status(self, request, context) -> pb.StatusResponse:
        load = self.engine.admission.load()
        return pb.StatusResponse(
            verifier_id=self.verifier_id,
            running=load["running"],
            capacity=self.settings.batch_size,
            request_ids=self.engine.running_ids(),
            steps=self.engine.steps,
            model=self.served.model,
            kv_budget=self.engine.admission.kv_budget,
            kv_used=load["kv_used"] * load["block_size"],
            kv_cached=load["kv_cached"] * load["block_size"],
            pool=self.served.pool,
            model_version=self.served.version,
            sha256=self.served.sha256,
            config=self.served.config,
        )

    def _free(self) -> int:
        return max(0, self.settings.batch_size - self.engine.admission.load()["running"])

    def registry_entry(self, address: str) -> dict:
        """What the scheduler places by (slots per class, KV blocks, limits, the cached
        prefixes), and what it checks ownership by: this start's incarnation and the requests
        running here, listed at `listed_ms` (see store/ownership.py)."""
        listed_ms = now_ms()  # (before the list: what is missing from it left by then)
        request_ids = ",".join(self.engine.running_ids())
        admission = self.engine.admission
        load = admission.load()
        metrics.RUNNING.set(load["running"])
        metrics.KV_USED.set(load["kv_used"] * load["block_size"])
        metrics.KV_CACHED.set(load["kv_cached"] * load["block_size"])
        if torch.cuda.is_available():
            metrics.ACCELERATOR_MEMORY.set(torch.cuda.memory_allocated())
        return {
            "address": address,
            "incarnation": self.incarnation,
            "request_ids": request_ids,
            "listed_ms": listed_ms,
            "model": self.served.model,
            "version": self.served.version,
            "pool": self.served.pool,
            "config": self.served.config,
            "capacity": admission.batch_size,
            "batch_capacity": admission.batch_slots,
            "kv_budget": admission.kv_budget,
            "max_seq_len": self.settings.max_seq_len,
            "draining": int(self.draining),
            "tensor_parallel": self.settings.tensor_parallel,
            "prefixes": ",".join(admission.pool.summary(self.settings.prefix_summary_blocks)),
            **load,
        }


def load_target(settings: VerifierSettings, path) -> tuple[object, Ranks | None]:
    """The target model, or with tensor_parallel > 1 rank 0's shard of it, the other ranks
    started and holding theirs (ranks.py)."""
    world = settings.tensor_parallel
    if world == 1:
        model = models.load_model(path, settings.device, settings.dtype, setting="verifier.dtype")
        metrics.WEIGHT_BYTES.labels("0").set(models.weight_bytes(model))
        return model, None
    from transformers import AutoConfig

    try:
        shard_config(AutoConfig.from_pretrained(str(path)), world)
    except ShardError as e:
        raise ConfigError(str(e)) from e
    ranks = Ranks.launch(path, settings)
    try:
        model = models.load_model(
            path, settings.device, settings.dtype, setting="verifier.dtype", shard=(0, world)
        )
        by_rank = {0: models.weight_bytes(model), **ranks.loaded()}
    except BaseException:
        ranks.close()
        raise
    for rank, size in by_rank.items():
        metrics.WEIGHT_BYTES.labels(str(rank)).set(size)
    log.info("tensor-parallel shards loaded", extra={"weight_bytes": by_rank})
    return model, ranks


def calibrate(speculator: Speculator, runner: ModelRunner) -> None:
    """Times the forward passes a step can make (Speculator.calibrate), before serving."""
    time_pass, most_tokens, done = runner.pass_timer()
    try:
        measured = speculator.calibrate(time_pass, most_tokens)
    finally:
        done()
    if measured:
        ms = {n: round(1000 * s, 2) for n, s in measured.items()}
        log.info("verify profile measured (ms by tokens in a pass)", extra={"profile": ms})


def build(settings: VerifierSettings) -> tuple[Server, callable]:
    models.set_host_threads(settings.torch_threads, settings.device, "verifier.torch_threads")
    path, manifest = models.resolve(settings.model, settings.model_cache_dir)
    with models.cpu_start(settings.model_cache_dir, settings.device, "verifier"):
        dtype = models.resolve_dtype(settings.dtype, settings.device, path, "verifier.dtype")
        settings = settings.model_copy(update={"dtype": dtype})  # (what the ranks load, too)
        model, ranks = load_target(settings, path)
    metrics.RANKS.set(settings.tensor_parallel)
    try:
        return serve(settings, path, manifest, model, ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def eos_ids_of(model, tokenizer) -> set[int]:
    """The tokens that end a sequence: the model's generation config's and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return eos_ids


def grpc_server(settings: VerifierSettings) -> Server:
    """The verifier's gRPC server (bound, not started). Under mTLS, only the scheduler
    admits and cancels; Status (what it serves) is any certificate's of the cluster
    (doctor's)."""
    name = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name
    scheduler_only = frozenset({"scheduler"})
    return Server(
        settings.host,
        settings.port,
        [name],
        callers={f"/{name}/Admit": scheduler_only, f"/{name}/Cancel": scheduler_only},
    )


def prepare(settings: VerifierSettings, model, ranks: Ranks | None) -> FlatModel:
    """The target as the engine runs it (compiled and warmed up, if asked), or a ConfigError
    naming the key that asked for what cannot run here."""
    try:
        flat, warm_up_s = FlatModel.prepare(
            model,
            compile=settings.compile,
            key="verifier.compile",
            on_graph=lambda _: metrics.COMPILED_GRAPHS.inc(),
            shards=ranks and ranks.shards,
            attention=settings.attention,
        )
    except CompileFailed as e:
        raise ConfigError(str(e)) from e
    except UnsupportedAttention as e:
        raise ConfigError(f"verifier.attention: {e}") from e
    metrics.WARM_UP_SECONDS.set(warm_up_s)
    return flat


def build_engine(
    settings: VerifierSettings,
    flat: FlatModel,
    store: RequestStore,
    speculator: Speculator,
    owner: Owner,
    tokenizer,
    eos_ids: set[int],
) -> Engine:
    """The engine over the prepared target: its KV pool (allocated now; its pages are
    touched as blocks fill), admission over that, and the verify profile timed."""
    cache, batch = settings.cache, settings.batch
    budget = kv_budget(cache.kv_budget_tokens, cache.kv_memory_fraction, flat)
    pool = flat.use_pool(budget, cache.kv_block_size, fixed=True, model_version=owner.model_version)
    metrics.KV_BUDGET.set(pool.tokens)
    runner = ModelRunner(flat)
    with models.cpu_start(settings.model_cache_dir, settings.device, "verifier"):
        calibrate(speculator, runner)  # (timed: alone on the cores)
    admission = Admission(
        pool,
        batch.batch_size,
        batch.interactive_reserved_slots,
        watermark_blocks=int(cache.kv_watermark * pool.blocks),
        prefix_cache=cache.prefix_cache,
    )
    return Engine(
        runner,
        speculator,
        store,
        admission,
        batch=batch,
        stream=settings.stream,
        speculation=settings.speculation,
        owner=owner,
        eos_ids=eos_ids,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


def serve(settings: VerifierSettings, path, manifest, model, ranks: Ranks | None):
    tokenizer = models.load_tokenizer(path)
    store = RequestStore.connect(settings)
    store.wait_reachable()
    store.ensure_queues()
    server = grpc_server(settings)
    address = settings.advertise_address or f"{settings.host}:{server.port}"
    speculator = Speculator(
        settings.speculation,
        settings.batch,
        model.config.vocab_size * settings.tensor_parallel,  # (a shard's is 1/N of it)
        discover=lambda: registered_drafters(store, settings.pool),
    )
    flat = prepare(settings, model, ranks)
    served = Served.of(settings, models.fingerprint(path, manifest), flat.attention)
    metrics.MODEL.labels(served.model, served.sha256, served.version, served.pool).set(1)
    owner = Owner(
        verifier_id=settings.verifier_id or address,
        incarnation=secrets.token_hex(8),  # new at every start: see "Failures and recovery"
        pool=served.pool,
        model_version=served.version,
    )
    eos_ids = eos_ids_of(model, tokenizer)
    engine = build_engine(settings, flat, store, speculator, owner, tokenizer, eos_ids)
    # (a lost rank: the verifier exits, to restart as a group)
    engine.lifecycle.on_lost = server.fail
    grammars = Grammars(tokenizer, model.config.vocab_size * settings.tensor_parallel)
    service = VerifierService(settings, engine, store, served, grammars)
    pb_grpc.add_VerifierServiceServicer_to_server(service, server.grpc)
    stop_hb = threading.Event()
    engine.start()
    # Registered before it serves: a claim by this incarnation is never older than its entry.
    store.heartbeat(
        owner.verifier_id, service.registry_entry(address), 3 * settings.heartbeat_seconds
    )
    server.start()
    heartbeat = threading.Thread(
        target=heartbeat_forever,
        args=(store, "verifier", owner.verifier_id, lambda: service.registry_entry(address)),
        kwargs={"period": settings.heartbeat_seconds, "stop": stop_hb},
        name="heartbeat",
        daemon=True,
    )
    heartbeat.start()
    if ranks is not None:
        ranks.watch(on_stuck=server.fail)
    server.watch(
        {"redis reachable": store.ping},
        liveness={  # (a broken model or device is restarted, not failing request after request)
            "decode loop going round": lambda: engine.alive(settings.stall_seconds),
            "steps succeeding": engine.healthy,
            "tensor-parallel ranks in step": lambda: not engine.lifecycle.lost,
        },
    )
    log.info(
        "verifier ready",
        extra={
            "address": address,
            "incarnation": owner.incarnation,
            "model": served.model,
            "version": served.version,
            "pool": served.pool,
            "config": served.config,
            "speculative_decoding": settings.speculative_decoding,
            "kv_budget_tokens": engine.admission.kv_budget,
            "kv_block_size": engine.admission.pool.block_size,
            "drafters": settings.drafter_addresses,
            "tensor_parallel": settings.tensor_parallel,
        },
    )

    def on_stop() -> None:
        """Drain: no new work; the batch finishes within the grace period, the rest goes
        back to the queue with its progress; then the registry entry goes."""
        service.draining = True
        handed = engine.lifecycle.drain(settings.drain_seconds)
        log.info("drained", extra={"handed_back": handed})
        stop_hb.set()
        heartbeat.join(timeout=5)
        speculator.close()
        if ranks is not None:  # (a loop still in a step holds the group: no stop through it)
            ranks.close(clean=not engine.thread.is_alive())

    return server, on_stop
