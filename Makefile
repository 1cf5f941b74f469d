# specserve: `make run` starts the local cluster, `make test` runs the tests.
# Every target sets up what it needs (venv, packages, protos, models) and is quick when done.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
PROTOS  = $(wildcard protos/specserve/v1/*.proto)
GEN     = services/v1/.generated
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: setup install kernels proto proto-check models run test test-fast test-long bench bench-load bench-kv bench-learn bench-spec bench-llamacpp bench-structured bench-tp bench-scale bench-http bench-engine gpu-check gpu-bundle lint \
	clean image image-gpu image-models k8s-secrets k8s-render

setup: install kernels proto models

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)

# The engine's C++ CPU kernels (services/engine/kernels), built once per source version, so
# that no service start waits on the compiler.
KERNELS = $(VENV)/.kernels
$(KERNELS): $(wildcard services/engine/kernels/*.cpp services/engine/kernels/*.inc) $(STAMP)
	$(PY) -m specserve.engine.kernels
	touch $@

kernels: $(KERNELS)

# Generated code lands in services/v1 (the import package specserve.v1), matching the proto package.
$(GEN): $(PROTOS) $(STAMP)
	rm -rf build/proto && mkdir -p build/proto
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=build/proto --pyi_out=build/proto \
		--grpc_python_out=build/proto $(PROTOS)
	cp build/proto/specserve/v1/*.py build/proto/specserve/v1/*.pyi services/v1/
	touch $@

proto: $(GEN)

# buf, from npm (Node.js's npm is on the machine; the binary is in the package).
BUF_VERSION = 1.75.0
BUF = build/buf/node_modules/.bin/buf
$(BUF):
	npm install --prefix build/buf --no-audit --no-fund --loglevel=error @bufbuild/buf@$(BUF_VERSION)

# The protos pass buf lint, and break nothing that any earlier v1 version had: each commit
# since buf.yaml came in that changed them is checked against (needs the git history).
proto-check: $(BUF)
	$(BUF) lint
	@base=$$(git log --diff-filter=A --format=%H -- buf.yaml | tail -1); \
	test -n "$$base" || { echo "proto-check: buf.yaml is in no commit (a shallow clone?)"; exit 1; }; \
	for c in $$base $$(git rev-list "$$base..HEAD" -- protos buf.yaml); do \
		$(BUF) breaking --against ".git#ref=$$c" || { echo "proto-check: breaks $$c"; exit 1; }; \
	done; echo "protos: lint clean, compatible with every version since $$(git rev-parse --short $$base)"

models: $(STAMP) $(GEN)
	$(VENV)/bin/specserve models fetch

run: setup
	$(VENV)/bin/specserve --config config/specserve.yaml up

# Test tiers by marker (tests/conftest.py): `make test` is what CI runs, every test but the
# `long` ones, and it prints the 30 slowest; `make test-fast` runs the unit tests (tests/unit/)
# that start no cluster and load no default target (a few minutes, while working); `make
# test-long` runs the tests whose length in real time is what they test (before a release).
test: setup proto-check
	$(PY) -m pytest -q -m "not long" --durations=30 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "unit and not cluster and not default_model and not long" $(PYTEST_ARGS)

test-long: setup
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

bench: setup
	$(PY) -m benchmarks.speculative --tokens 128 --dtype bfloat16
	$(PY) -m benchmarks.plain_decode --dtype bfloat16
	$(PY) -m benchmarks.plan_check --dtype bfloat16

bench-load: setup
	$(PY) -m benchmarks.load --rates 0.1,0.25,0.4,0.55 --duration 75 --tokens 48 --dtype bfloat16 --batch-size 4

# KV memory: users sharing a system prompt (prefix cache on and off), and how many sequences
# one KV budget runs at once (blocks against reserving the worst case).
bench-kv: setup
	$(VENV)/bin/specserve models fetch smollm2-135m-instruct@0.1.2
	$(PY) -m benchmarks.prefix_cache --users 8 --rounds 2 --tenants 2 --dtype float32
	$(PY) -m benchmarks.kv_concurrency --tiny --requests 48 --max-seq-len 4096
	$(PY) -m benchmarks.kv_concurrency --tiny --requests 48 --max-seq-len 8192
	$(PY) -m benchmarks.kv_concurrency --tiny --requests 48 --max-seq-len 4096 --block-size 32

# Proposers that learn (docs/benchmarks.md, "Speculation that learns"): float32, as bfloat16 is slow on
# CPUs without AMX; then 20 requests of one tenant sharing a tool-call schema.
# BENCH_DEVICE=cuda (and BENCH_DTYPE=bfloat16) on a machine with a GPU.
BENCH_DEVICE ?= cpu
BENCH_DTYPE ?= float32
bench-learn: setup
	$(PY) -m benchmarks.speculative --dtype $(BENCH_DTYPE) --device $(BENCH_DEVICE) \
		--only "chain 6" "ngram 10" suffix default prompt_lookup
	$(PY) -m benchmarks.agentic --dtype $(BENCH_DTYPE) --device $(BENCH_DEVICE)

# Spec-Bench (../shared/workloads), the standard library's code edits and the agentic tool
# calls (benchmarks/workloads.py): the default config (dtype auto) with speculation on and off
# through the cluster at concurrency 1, 4 and 16; then each proposer's tokens per step replayed
# against the target's cached greedy output (docs/benchmarks.md, "The default config on this CPU").
bench-spec: setup
	$(PY) -m benchmarks.spec_bench --per-category 1 --tokens 96 --concurrency 1,4,16 \
		--workload spec_bench,code_edit,agentic
	$(PY) -m benchmarks.acceptance --per-category 4 --tokens 128

# The default config against llama.cpp (built here once from PyPI's sdist) on the same GGUF, every
# row three times afresh (the machine drifts between minutes: the targets' ratios are paired by round).
bench-llamacpp: setup
	$(PY) -m benchmarks.llamacpp --tokens 128 --threads 2 --rounds 3

# Structured outputs and tool calls: grammar and speculation on and off, forced drafts on and
# off (docs/benchmarks.md, "Structured outputs").
bench-structured: setup
	$(PY) -m benchmarks.structured --extraction 6 --tools 6 --tokens 96

# The default target over 2 ranks x 1 thread against 1 rank x 2 threads (docs/benchmarks.md, "Tensor
# parallelism"); BENCH_DEVICE=cuda on a machine with 2 GPUs.
bench-tp: setup
	$(PY) -m benchmarks.tensor_parallel --ranks 2 --threads 2 --dtype float32 --device $(BENCH_DEVICE)

# Many streams and long outputs: 2,000 streams on one gateway process; 8,000-token outputs
# through a gateway kill; what a step pays for its Redis write (sync against async).
bench-scale: setup
	$(PY) -m benchmarks.scale --streams 2000 --seconds 20 --step-ms 1000 --batch 64
	$(PY) -m benchmarks.long_output --tokens 8000 --batch 4
	$(VENV)/bin/specserve models fetch smollm2-135m-instruct@0.1.2
	$(PY) -m benchmarks.step_writes --tiny --threads 1 --reps 5
	$(PY) -m benchmarks.step_writes --threads 2 --reps 3 --tokens 64

# Time per output token streamed over the OpenAI-compatible HTTP API against gRPC, same run.
bench-http: setup
	$(PY) -m benchmarks.http_stream --rounds 12 --tokens 200 --concurrency 4

# The engine alone (no cluster) against its bandwidth bounds; LABEL keys the run in
# benchmarks/results/engine.json (e.g. `make bench-engine LABEL=after`).
LABEL ?= latest
bench-engine: setup
	$(VENV)/bin/specserve models fetch smollm2-135m-instruct@0.1.2
	$(PY) -m benchmarks.engine --label $(LABEL) --dtype bfloat16 --threads 2
	$(PY) -m benchmarks.step_counts --label $(LABEL)

# The engine's tests on a device and short benchmarks there, unattended and bounded
# (docs/operations.md, "GPU check"): results in build/gpu-check/results/results.json. No setup: it runs with the
# machine's python3 where there is no venv, after `make gpu-bundle` packed what it lacks.
DEVICE ?= cuda
GPU_CHECK_BUDGET ?= 540
CHECK_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-check:
	$(CHECK_PY) -m benchmarks.gpu_check --device $(DEVICE) --budget $(GPU_CHECK_BUDGET) $(GPU_CHECK_ARGS)

gpu-bundle: setup
	$(PY) -m benchmarks.gpu_bundle

lint: install proto
	$(VENV)/bin/ruff check services tests benchmarks
	$(VENV)/bin/ruff format --check services tests benchmarks

# Container image (one for every role) and Kubernetes (deploy/k8s; docs/operations.md, "Deploy").
image:
	docker build -t specserve:latest .

image-gpu:
	docker build -t specserve:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .

# specserve:latest with the default models' wheels inside (deploy/k8s/components/air-gapped).
image-models: image
	docker build -t specserve-models:latest -f Dockerfile.models .

k8s-secrets: install
	deploy/k8s/dev-secrets.sh

k8s-render:
	kubectl kustomize deploy/k8s/overlays/dev >/dev/null && kubectl kustomize deploy/k8s/overlays/gpu >/dev/null

clean:
	rm -rf build services/v1/*_pb2*.py services/v1/*_pb2*.pyi $(GEN)
