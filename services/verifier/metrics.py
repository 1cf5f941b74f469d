"""The verifier's Prometheus metrics (served when `metrics_port` is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)

COMPILED_GRAPHS = Counter(
    "specserve_verifier_compiled_graphs_total",
    "Graphs torch.compile built for the forward (the first compiles and every recompile).",
)
WARM_UP_SECONDS = Gauge(
    "specserve_verifier_warm_up_seconds",
    "Seconds the forward's warm-up took at start (compiling, when verifier.compile is on).",
)
STEPS = Counter("specserve_verifier_steps_total", "Decode steps (one forward pass each).")
VERIFY_SECONDS = Histogram(
    "specserve_verifier_verify_seconds", "Target forward pass of one step.", buckets=_STEP_BUCKETS
)
DRAFT_SECONDS = Histogram(
    "specserve_verifier_draft_seconds",
    "Time a step waited for its draft trees (drafter round trip or fallback).",
    buckets=_STEP_BUCKETS,
)
ACCEPTED_LENGTH = Histogram(
    "specserve_verifier_accepted_length",
    "Tokens emitted per sequence per step (accepted drafts + 1).",
    buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64),
)
DRAFTED_TOKENS = Counter("specserve_verifier_drafted_tokens_total", "Draft nodes verified.")
ACCEPTED_TOKENS = Counter("specserve_verifier_accepted_tokens_total", "Draft tokens accepted.")
FALLBACK_STEPS = Counter(
    "specserve_verifier_fallback_steps_total",
    "Sequence steps drafted by the fallback because the drafter failed or was late.",
)
GENERATED_TOKENS = Counter("specserve_verifier_generated_tokens_total", "Tokens emitted.")
BATCH_SIZE = Histogram(
    "specserve_verifier_batch_size",
    "Sequences in one step's forward pass.",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
)
PREFILL_TOKENS = Counter("specserve_verifier_prefill_tokens_total", "Prompt tokens prefilled.")
PREFILL_CHUNKS = Counter(
    "specserve_verifier_prefill_chunks_total",
    "Prompt pieces prefilled (one per sequence per step).",
)
PREFIX_CACHE_TOKENS = Counter(
    "specserve_verifier_prefix_cache_tokens_total",
    "Prompt tokens whose KV was taken from the prefix cache instead of computed.",
)
KV_BUDGET = Gauge("specserve_verifier_kv_budget_tokens", "KV cache budget in tokens.")
KV_USED = Gauge("specserve_verifier_kv_used_tokens", "KV tokens in blocks sequences hold.")
KV_CACHED = Gauge(
    "specserve_verifier_kv_cached_tokens", "KV tokens in cached blocks (prefix cache), held or not."
)
PREEMPTIONS = Counter(
    "specserve_verifier_preemptions_total",
    "Sequences preempted for KV room (recomputed once blocks were free again).",
)
RUNNING = Gauge("specserve_verifier_running", "Sequences admitted to the batch.")
PAUSED = Gauge(
    "specserve_verifier_paused", "Sequences paused: their clients are not reading their output."
)
UNREAD_ENDED = Counter(
    "specserve_verifier_unread_ended_total",
    "Sequences ended after pause_timeout_seconds paused (their clients stopped reading).",
)
TREE_BUDGET = Histogram(
    "specserve_verifier_tree_budget",
    "Draft tree nodes asked for per sequence per step (0: plain decoding).",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
DRAFTERS = Gauge("specserve_verifier_drafters", "Drafters this verifier streams with.")
CANCEL_STEPS = Histogram(
    "specserve_verifier_cancel_steps",
    "Steps from a Cancel reaching the verifier to the sequence leaving the batch.",
    buckets=(0, 1, 2, 3, 5, 10, 20),
)
HANDED_BACK = Counter(
    "specserve_verifier_handed_back_total",
    "Unfinished requests handed back to the queue on drain.",
)
ACCELERATOR_MEMORY = Gauge(
    "specserve_verifier_accelerator_memory_bytes",
    "Accelerator memory allocated by this process (0 on a CPU).",
)
MODEL = Gauge(
    "specserve_verifier_model_info",
    "The target model this verifier serves (always 1; the labels say which).",
    ["model", "sha256", "version", "pool"],
)
FAILED_SEQUENCES = Counter(
    "specserve_verifier_failed_sequences_total",
    "Sequences ended with FINISH_REASON_ERROR by a failure in their step.",
)
FAILED_STEPS = Counter(
    "specserve_verifier_failed_steps_total",
    "Steps that failed for every sequence in them (health turns NOT_SERVING after a few).",
)
WEIGHT_BYTES = Gauge(
    "specserve_verifier_weight_bytes",
    "Bytes of the target's weights each rank holds (one rank unless tensor parallel).",
    ["rank"],
)
RANKS = Gauge("specserve_verifier_tensor_parallel_ranks", "Ranks the target model spans.")
