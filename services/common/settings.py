"""Settings of each service: one pydantic-settings model per service.

Values come from a YAML file (kept apart from code; sections `common` and one per service)
overridden by environment variables `SPECSERVE_<SERVICE>_<KEY>` (nested keys joined by `__`).
Everything is validated at start; a bad value raises ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

G = TypeVar("G")  # a settings group (VerifierSettings._view)
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
Dtype = Literal["auto", "float32", "bfloat16", "float16", "int8", "int4"]
DTYPE_HELP = (
    "auto: chosen at start for the device and logged (CUDA: bfloat16; CPU: whichever of "
    "int4, int8, bfloat16 where native, float32 decodes fastest there; engine/dtypes.py). "
    "int8 / int4: weight-only quantised linear layers (per channel / per group of 32), "
    "the rest in float32; a device whose torch build lacks the kernel stops the service."
)
COMPILE_HELP = (
    "torch.compile decode and tree steps (up to 64 new tokens a sequence) as one graph over "
    "persistent, bucketed buffers (inductor; at start, counted as compiled graphs); longer "
    "prompt chunks run eagerly. false (the default) runs every step eagerly: on CPU the graph "
    "step is about as fast as eager (README: Engine) and the start takes longer."
)


def runnable_device(device: str) -> str:
    """`device` if this build of torch can run models there: "cpu", or "cuda" / "cuda:N" with
    CUDA built in and device N visible. Checked when the settings load, so a service that
    cannot use its device stops at start with the key named, not at its first forward pass."""
    if device == "cpu":
        return device
    import torch  # only where a GPU is asked for: the gateway and scheduler never load it

    if not torch.cuda.is_available():
        built = f"torch {torch.__version__}"
        why = "built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"{device} cannot run here: {built}, {why}; use cpu")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(
            f"{device} cannot run here: {count} CUDA device(s) visible (0..{count - 1})"
        )
    return device


# Where a service runs its model: cpu, cuda (the current CUDA device) or cuda:N.
Device = Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$"), AfterValidator(runnable_device)]


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key."""


class ModelRef(BaseModel):
    """A model named by catalog name and version, or a local Hugging Face directory."""

    model_config = {"extra": "forbid"}

    name: str = "qwen2.5-coder-1.5b-instruct"
    version: str = "0.2.0"
    path: str | None = Field(
        default=None, description="Local model directory; overrides name/version when set."
    )

    @property
    def label(self) -> str:
        return self.path if self.path else f"{self.name}@{self.version}"


class ServiceSettings(BaseSettings):
    """Keys every service has."""

    section: ClassVar[str] = "common"
    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = Field(
        default=False,
        description="redis_url names a node of a Redis Cluster (keys hash-tagged by shard).",
    )
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        description="Replicas that must hold a request's creation and its end before either "
        "is acknowledged (WAIT); 0: acknowledged once the master has it.",
    )
    redis_wait_timeout_ms: int = Field(
        default=1000, gt=0, description="How long a write waits for redis_wait_replicas."
    )
    log_level: LogLevel = "INFO"
    timeout_seconds: float = Field(default=30.0, gt=0, description="Deadline of internal RPCs.")
    otlp_endpoint: str | None = Field(
        default=None, description="OTLP/gRPC collector for traces (Jaeger: :4317); none: off."
    )
    trace_sample_ratio: float = Field(
        default=1.0, ge=0, le=1, description="Share of requests traced (decided at the gateway)."
    )
    trace_step_sample_ratio: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="Share of a traced request's decode steps whose spans are kept (a step "
        "span per step would grow a minutes-long request's trace to thousands of spans).",
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="Prometheus /metrics port; unset = none."
    )
    drain_seconds: float = Field(default=10.0, ge=0, description="Grace period on SIGTERM.")
    health_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Plaintext grpc.health.v1 for the kubelet's gRPC probes (services "
        "`liveness` and `readiness`), bound at start; unset = none.",
    )
    heartbeat_seconds: float = Field(default=1.0, gt=0)
    insecure: bool = Field(
        default=False, description="Plaintext gRPC, no certificates: local development only."
    )
    tls_ca_file: str | None = Field(default=None, description="The CA of the cluster (PEM).")
    tls_cert_file: str | None = Field(default=None, description="This service's certificate.")
    tls_key_file: str | None = Field(default=None, description="This service's private key.")
    tls_server_name: str = Field(
        default="specserve.internal",
        description="The domain of internal certificates' names: a service's is valid for "
        "<service>.<this> (peers are often dialled by IP).",
    )
    model_cache_dir: str = str(Path.home() / ".cache" / "specserve" / "models")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_: Any):
        # Environment overrides the YAML file (which arrives as init kwargs).
        return (env_settings, init_settings)

    @classmethod
    def load(cls, config_path: str | Path | None = None, **overrides: Any) -> Self:
        """Reads the `common` and own sections of the YAML file, then env, then overrides."""
        data: dict[str, Any] = {}
        where = "settings"
        if config_path:
            where = str(config_path)
            try:
                raw = yaml.safe_load(Path(config_path).read_text()) or {}
            except OSError as e:
                raise ConfigError(f"cannot read config file {config_path}: {e.strerror}") from e
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {config_path} is not valid YAML: {e}") from e
            if not isinstance(raw, dict):
                raise ConfigError(f"config file {config_path} must hold a mapping of sections")
            data = {**(raw.get("common") or {}), **(raw.get(cls.section) or {})}
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join([cls.section, *map(str, err['loc'])])}: {err['msg']}"
                for err in e.errors()
            )
            raise ConfigError(f"invalid configuration in {where}: {problems}") from None


class Tier(BaseModel):
    """What an API key of a tier may do; a key copies its tier's limits when it is created."""

    model_config = {"extra": "forbid"}

    requests_per_minute: int = Field(default=60, ge=1)
    tokens_per_minute: int = Field(
        default=100_000, ge=1, description="Prompt + generated tokens per minute."
    )
    concurrent_streams: int = Field(default=8, ge=1, description="Open Generate streams.")
    max_tokens: int = Field(default=8192, ge=1, description="Largest max_tokens it may ask.")
    batch: bool = Field(default=False, description="May use the batch priority class.")


DEFAULT_TIERS = {
    "free": Tier(
        requests_per_minute=20,
        tokens_per_minute=20_000,
        concurrent_streams=2,
        max_tokens=512,
        batch=False,
    ),
    "standard": Tier(),
    "batch": Tier(
        requests_per_minute=600,
        tokens_per_minute=1_000_000,
        concurrent_streams=64,
        max_tokens=8192,
        batch=True,
    ),
}


class GatewaySettings(ServiceSettings):
    section: ClassVar[str] = "gateway"
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_GATEWAY_", extra="forbid")

    port: int = Field(default=50051, ge=0, le=65535)
    scheduler_address: str = "127.0.0.1:50052"
    model: ModelRef = ModelRef()
    max_seq_len: int = Field(
        default=16384, gt=1, description="Longest prompt + output (long reasoning: 8k out)."
    )
    max_tokens_limit: int = Field(default=8192, gt=0, description="Largest max_tokens.")
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_length: int = Field(default=64, gt=0)
    max_workers: int = Field(
        default=64,
        gt=0,
        description="Threads for blocking work (Redis commands, scheduler calls); an open "
        "stream holds none.",
    )
    tokenizer_workers: int = Field(
        default=4,
        gt=0,
        description="Threads that tokenize prompts (and apply the chat template), apart from "
        "the threads that authenticate and charge callers: a flood of long prompts waits for "
        "these without holding up anyone's key check.",
    )
    first_message_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="A call's request message (gRPC) or body (HTTP) must arrive within this "
        "of its headers, or the call ends (gRPC DEADLINE_EXCEEDED, HTTP 408); while it has "
        "not, the call counts against its key's concurrent streams on this gateway.",
    )
    result_cache_ttl_seconds: float = Field(
        default=600.0, gt=0, description="How long an opted-in deterministic result is reused."
    )
    auth: Literal["api_key", "off"] = Field(
        default="api_key",
        description="api_key: every call needs `authorization: Bearer <key>`; off: local "
        "development only (one anonymous tenant, no quotas).",
    )
    api_keys_file: str | None = Field(
        default=None,
        description="YAML list of {key, tenant, tier} seeded into Redis at start (e.g. a "
        "mounted Secret); the keys are stored hashed.",
    )
    prefix_cache_scope: Literal["tenant", "global"] = Field(
        default="tenant",
        description="Whose earlier requests a request's cached prompt blocks and cached "
        "result may come from: its tenant's (default) or anyone's. The gateway writes the "
        "scope into each request (SubmitRequest.prefix_scope), and placement and the "
        "verifiers' prefix cache key blocks by it; `global` lets one tenant learn from "
        "`cached_prompt_tokens`, `cached` and timings what another sent (one trust domain "
        "only).",
    )
    tiers: dict[str, Tier] = Field(default=DEFAULT_TIERS, description="Limits per key tier.")
    max_concurrent_rpcs: int = Field(
        default=10_000,
        gt=0,
        description="RPCs in flight (open streams included) beyond this get "
        "RESOURCE_EXHAUSTED at once.",
    )
    audit_max_entries: int = Field(
        default=100_000, gt=0, description="Length the Redis audit stream is trimmed to."
    )
    http_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models); unset = none; 0 = any free port.",
    )
    http_model_aliases: list[str] = Field(
        default=[],
        description="More names the HTTP API accepts in `model` for the served model (as "
        "`--served-model-name` does in vLLM), e.g. for clients with a model name built in.",
    )
    http_max_body_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="Largest HTTP request body (413 above)."
    )


class SchedulerSettings(ServiceSettings):
    section: ClassVar[str] = "scheduler"
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_SCHEDULER_", extra="forbid")

    port: int = Field(default=50052, ge=0, le=65535)
    interactive_queue_limit: int = Field(default=256, ge=1)
    batch_queue_limit: int = Field(default=1024, ge=1)
    interactive_queue_timeout_seconds: float = Field(
        default=60.0, gt=0, description="Longest wait in the interactive queue."
    )
    batch_queue_timeout_seconds: float = Field(
        default=1800.0, gt=0, description="Longest wait in the batch queue."
    )
    interactive_burst: int = Field(
        default=4,
        ge=1,
        description="Interactive placements in a row after which a waiting batch request goes "
        "first (the bound on batch starvation).",
    )
    placement_poll_seconds: float = Field(default=0.05, gt=0)
    scheduler_id: str | None = Field(
        default=None, description="Queue consumer name; the host name if unset."
    )
    dead_verifier_grace_seconds: float = Field(
        default=2.0,
        ge=0,
        description="How long a verifier's registry entry must stay gone (its heartbeats "
        "missed) before its running requests are requeued.",
    )
    orphan_grace_seconds: float = Field(
        default=2.0,
        ge=0,
        description="A request a live verifier does not list among those it runs is requeued "
        "if it was claimed this long before one list and is missing from the next one too.",
    )
    reclaim_idle_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Queue entries another scheduler read and left idle this long are taken over.",
    )
    version_wait_seconds: float = Field(
        default=120.0,
        gt=0,
        description="How long a requeued request waits for a verifier of the model version it "
        "started on (its stream never mixes versions) before it fails.",
    )
    tenant_slot_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Most of the live verifiers' batch slots one tenant's requests may hold "
        "(at least one slot); the rest stay free for other tenants. 1 turns the cap off. "
        "Requests without a tenant (auth off) are not capped.",
    )
    tenant_stored_bytes_limit: int = Field(
        default=256 * 2**20,
        ge=0,
        description="Most bytes of Redis one tenant's requests of the last hour may hold "
        "(each: its prompt and parameters, and 16 bytes per token it may generate); past it "
        "the tenant's new requests get RESOURCE_EXHAUSTED. 0 turns the cap off; requests "
        "without a tenant (auth off) are not capped.",
    )
    redis_memory_admit_fraction: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="New requests are refused (RESOURCE_EXHAUSTED, retry later) while Redis "
        "uses more than this share of its maxmemory: the rest is kept for the requests "
        "running (their steps, ends and heartbeats), so a full Redis stops new work, never "
        "the cluster. 1: only a Redis out of memory refuses.",
    )


# --- the verifier's settings, by concern (VerifierSettings' views) ---------------------------
SpeculationPolicy = Literal["adaptive", "fixed"]
FallbackMode = Literal["plain", "ngram"]


@dataclass(frozen=True)
class BatchSettings:
    """The running batch: its slots, and how long and how fast its sequences grow."""

    batch_size: int
    interactive_reserved_slots: int
    max_seq_len: int
    max_prefill_tokens: int


@dataclass(frozen=True)
class CacheSettings:
    """The KV cache: its size, its blocks, and the prefix cache over them."""

    kv_budget_tokens: int
    kv_memory_fraction: float
    kv_block_size: int
    kv_watermark: float
    prefix_cache: bool
    prefix_summary_blocks: int


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding: the drafters, their trees' sizes, and what a step does without."""

    speculative_decoding: bool
    drafter_addresses: list[str]
    discover_drafters: bool
    verification_tree_size: int
    deep_tree_size: int
    speculation_policy: SpeculationPolicy
    draft_timeout_seconds: float
    forced_drafts: bool
    fallback_mode: FallbackMode
    breaker_failures: int
    breaker_cooldown_seconds: float


@dataclass(frozen=True)
class StreamSettings:
    """How a step's tokens reach Redis, and how a client that does not read holds its own."""

    async_step_writes: bool
    max_unread_tokens: int
    pause_timeout_seconds: float


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor parallelism: the ranks the target model is split over."""

    tensor_parallel: int
    tensor_parallel_timeout_seconds: float


class VerifierSettings(ServiceSettings):
    """The verifier's keys, flat as the YAML file and the environment name them
    (`verifier: {kv_block_size: 16}`, SPECSERVE_VERIFIER_KV_BLOCK_SIZE): they are what is
    loaded and validated. Each concern is also a typed, frozen view of them (`batch`,
    `cache`, `speculation`, `stream`, `parallel`), its fields the keys by the same names; the
    engine and its parts take the views they need."""

    section: ClassVar[str] = "verifier"
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_VERIFIER_", extra="forbid")

    # --- who it is and where (flat) ---------------------------------------------------------
    port: int = Field(default=50053, ge=0, le=65535)
    verifier_id: str | None = Field(default=None, description="Registry id; host:port if unset.")
    advertise_address: str | None = Field(
        default=None, description="Address the scheduler dials; host:port if unset."
    )
    pool: Literal["stable", "canary"] = Field(
        default="stable",
        description="Rollout pool; the canary gets the share of new requests that "
        "`specserve rollout canary` sets (none until then).",
    )
    stall_seconds: float = Field(
        default=120.0,
        gt=0,
        description="A decode step running longer than this reports NOT_SERVING (wedged).",
    )

    # --- the model and what runs it (flat) --------------------------------------------------
    model: ModelRef = ModelRef()
    device: Device = "cpu"
    dtype: Dtype = Field(default="float32", description=DTYPE_HELP)
    compile: bool = Field(default=False, description=COMPILE_HELP)
    attention: Literal["auto", "padded", "paged"] = Field(
        default="auto",
        description="Attention kernel. paged: the engine's CPU kernel, reading each "
        "sequence's KV in place through its slots (float32 activations on a CPU, eager); "
        "padded: torch's SDPA over the entries gathered into a padded batch (any device); "
        "auto: paged where it runs (on this CPU it measured faster at every batch), else "
        "padded. An explicit paged where it cannot run stops the start.",
    )
    torch_threads: int = Field(
        default=0, ge=0, description="0: torch's default on the CPU (per rank), 1 on a GPU."
    )

    # --- the running batch (settings.batch) -------------------------------------------------
    batch_size: int = Field(default=8, ge=1, description="Most sequences in the running batch.")
    interactive_reserved_slots: int = Field(
        default=1, ge=0, description="Batch slots that batch-class work may not take."
    )
    max_seq_len: int = Field(
        default=16384, gt=1, description="Longest prompt + output a sequence may reach."
    )
    max_prefill_tokens: int = Field(
        default=512,
        ge=1,
        description="Prompt tokens prefilled per step (longer prompts are chunked).",
    )

    # --- the KV cache (settings.cache) ------------------------------------------------------
    kv_budget_tokens: int = Field(
        default=0, ge=0, description="KV cache budget in tokens; 0 derives it from free memory."
    )
    kv_memory_fraction: float = Field(
        default=0.3,
        gt=0,
        le=0.95,
        description="Share of free memory at start the KV may use (on the CPU: available RAM, "
        "or what the container's memory limit leaves if less).",
    )
    kv_block_size: int = Field(
        default=16, ge=1, le=1024, description="Tokens per KV block (the unit of KV memory)."
    )
    kv_watermark: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="Share of the KV blocks admission keeps free for running sequences to grow.",
    )
    prefix_cache: bool = Field(
        default=True,
        description="Share full KV blocks between requests with the same prefix (any request, "
        "no session needed); unreferenced ones stay cached and are evicted LRU.",
    )
    prefix_summary_blocks: int = Field(
        default=1024,
        ge=0,
        description="Cached block hashes the heartbeat publishes for prefix-aware placement.",
    )

    # --- speculative decoding (settings.speculation) ----------------------------------------
    speculative_decoding: bool = Field(
        default=False, description="Ask drafters for trees; off = plain decoding."
    )
    drafter_addresses: list[str] = Field(
        default=[], description="Drafters to stream with, besides those registered in Redis."
    )
    discover_drafters: bool = Field(
        default=True, description="Also use the drafters registered in Redis (added live)."
    )
    verification_tree_size: int = Field(
        default=8,
        ge=0,
        le=256,
        description="Most nodes per sequence per step of a tree a draft model grows.",
    )
    deep_tree_size: int = Field(
        default=64,
        ge=0,
        le=256,
        description="Most nodes per sequence per step of a model-free tree (a suffix or n-gram "
        "match: no draft pass), so copying sequences draft deep; adaptive: within it, as far "
        "as the nodes pay for their verification.",
    )
    speculation_policy: SpeculationPolicy = Field(
        default="adaptive",
        description="adaptive: tree size per step from a cost model (down to 0); "
        "fixed: verification_tree_size.",
    )
    draft_timeout_seconds: float = Field(
        default=5.0, gt=0, description="A step's drafts arriving later than this are not used."
    )
    forced_drafts: bool = Field(
        default=True,
        description="Where a request's grammar forces the next tokens, draft them (free, "
        "accepted whole) instead of the drafter's tree.",
    )
    fallback_mode: FallbackMode = Field(
        default="plain", description="How a step is drafted when the drafter is unavailable."
    )
    breaker_failures: int = Field(
        default=3, ge=1, description="Consecutive drafter failures that open the breaker."
    )
    breaker_cooldown_seconds: float = Field(
        default=10.0, ge=0, description="How long an open breaker skips the drafter."
    )

    # --- writing tokens and slow readers (settings.stream) ----------------------------------
    async_step_writes: bool = Field(
        default=True,
        description="Write a step's tokens to Redis while the next step computes (one write "
        "in flight); false: each step waits for its write.",
    )
    max_unread_tokens: int = Field(
        default=256,
        ge=0,
        description="A sequence pauses (keeping its slot and KV) while it is this many tokens "
        "ahead of what the gateway has sent its client; 0: never pause.",
    )
    pause_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A sequence paused this long ends (cancelled) and frees its slot.",
    )

    # --- tensor parallelism (settings.parallel) ---------------------------------------------
    tensor_parallel: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks the target model is split over (one process and device each; "
        "rank 0 serves). Must divide its attention heads, KV heads, intermediate size and "
        "vocabulary; on cuda, one visible device per rank from `device` on.",
    )
    tensor_parallel_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="How long the ranks may take to meet at start (and at least 300 s to load "
        "their shards), and one exchange between them within a step, before the verifier "
        "gives up and stops: a stuck rank never hangs it. Waiting for work has no limit.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.interactive_reserved_slots >= self.batch_size:
            raise ValueError("interactive_reserved_slots must be below batch_size")
        if self.tensor_parallel > 1 and self.device != "cpu":
            import torch

            from ..engine.tensor_parallel import rank_devices

            rank_devices(self.device, self.tensor_parallel, torch.cuda.device_count())
        return self

    @property
    def batch(self) -> BatchSettings:
        return self._view(BatchSettings)

    @property
    def cache(self) -> CacheSettings:
        return self._view(CacheSettings)

    @property
    def speculation(self) -> SpeculationSettings:
        return self._view(SpeculationSettings)

    @property
    def stream(self) -> StreamSettings:
        return self._view(StreamSettings)

    @property
    def parallel(self) -> ParallelSettings:
        return self._view(ParallelSettings)

    def _view(self, group: type[G]) -> G:
        """The group's fields, read from the flat keys of the same names (built on each use:
        a copy with other values, `model_copy(update=...)`, has its own views)."""
        return group(**{f.name: getattr(self, f.name) for f in fields(group)})


class DrafterSettings(ServiceSettings):
    section: ClassVar[str] = "drafter"
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_DRAFTER_", extra="forbid")

    port: int = Field(default=50054, ge=0, le=65535)
    advertise_address: str | None = Field(
        default=None,
        description="Address verifiers dial (registered in Redis); host:port if unset.",
    )
    pool: Literal["stable", "canary"] = Field(
        default="stable", description="Rollout pool: only verifiers of this pool draft with it."
    )
    proposer: Literal["draft_model", "ngram", "suffix", "hybrid"] = Field(
        default="hybrid",
        description="hybrid: per sequence and step, the suffix tree or the draft model, "
        "whichever is expected to have more tokens accepted.",
    )
    draft_model: ModelRef = ModelRef(name="qwen2.5-coder-0.5b-instruct", version="0.9.0")
    draft_model_path: str | None = Field(default=None, description="Overrides draft_model.")
    device: Device = "cpu"
    dtype: Dtype = Field(default="float32", description=DTYPE_HELP)
    compile: bool = Field(default=False, description=COMPILE_HELP)
    torch_threads: int = Field(
        default=0, ge=0, description="0: torch's default on the CPU, 1 on a GPU."
    )
    max_depth: int = Field(
        default=6, ge=1, le=64, description="Draft model tree levels (one forward pass each)."
    )
    branching: int = Field(default=2, ge=1, le=16, description="Children per expanded node.")
    width: int = Field(default=4, ge=1, le=64, description="Nodes expanded per level.")
    min_path_prob: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Nodes whose cumulative draft probability is below this get no children.",
    )
    sample_support: int = Field(
        default=32, ge=1, description="Tokens kept in the draft distribution of sampled trees."
    )
    draft_vocab: int = Field(
        default=0,
        ge=0,
        description="The draft model's LM head computes the logits of this many tokens, the "
        "lowest ids (a BPE tokenizer numbers its tokens most frequent first), and of every "
        "added token; the others are never drafted. 0: the whole vocabulary.",
    )
    ngram_min: int = Field(default=1, ge=1, description="Shortest suffix the n-gram matches.")
    ngram_max: int = Field(default=4, ge=1, description="Longest suffix the n-gram matches.")
    ngram_depth: int = Field(
        default=10, ge=1, le=256, description="Longest continuation an n-gram match proposes."
    )
    run_ahead: bool = Field(
        default=False,
        description="While the verifier verifies a step, draft the next one as if each greedy "
        "tree's likeliest path were accepted (used only if it was). Pays where drafter and "
        "verifier have their own cores or devices; not on a machine where they share them.",
    )
    suffix_max_depth: int = Field(
        default=64, ge=1, le=256, description="Deepest suffix-tree draft (long matches)."
    )
    suffix_max_match: int = Field(
        default=32, ge=1, le=1024, description="Longest history suffix the suffix tree matches."
    )
    suffix_depth_factor: float = Field(
        default=2.0, gt=0, description="Suffix draft depth per matched token (then max_depth)."
    )
    suffix_min_match: int = Field(
        default=1,
        ge=1,
        description="Shortest matched suffix the suffix tree drafts from (1: any token seen "
        "before; its children are still cut by suffix_min_token_prob).",
    )
    suffix_min_token_prob: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Suffix-tree children followed by a smaller share of the occurrences are cut.",
    )
    suffix_scope: Literal["tenant", "global", "none"] = Field(
        default="tenant",
        description="Whose completed outputs shape a request's suffix drafts: its tenant's "
        "(default), every tenant's (one trust domain only: acceptance speed would tell one "
        "tenant what others generated), or none.",
    )
    suffix_tenant_tokens: int = Field(
        default=32768, ge=0, description="Completed-output tokens kept per tenant (oldest go)."
    )
    suffix_tenants: int = Field(
        default=8, ge=1, description="Tenants whose outputs are kept (least recent go)."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must not exceed ngram_max")
        return self


SETTINGS_BY_SERVICE: dict[str, type[ServiceSettings]] = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "verifier": VerifierSettings,
    "drafter": DrafterSettings,
}
