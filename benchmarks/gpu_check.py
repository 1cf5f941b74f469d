"""`make gpu-check`: the tests that run the engine on a device and short benchmarks there, in
one unattended run of bounded time. Results: build/gpu-check/results/results.json, with a log
per stage beside it.

    python -m benchmarks.gpu_check [--device cuda] [--budget 540] [--quick] [--skip-bench]
                                   [--tests NODE ...] [--out DIR]

Stages, each a subprocess under a time limit (its own, cut to what is left of --budget): a
stage that fails or runs out of time is recorded, the processes it started are ended, and the
next one runs. results.json is rewritten after every stage, so what finished is there even
when the whole run is killed.

  bundle       only where packages are missing: installs the wheels of
               build/gpu-check/bundle.tgz (benchmarks/gpu_bundle.py)
  environment  versions, the device, the services' imports, the settings' device check
  tests        the tests whose models run on the device (SPECSERVE_TEST_DEVICE): tree attention
               against HF, the KV pool, the compiled forward, the device reads and copies of
               a verifier and a drafter step, speculative output = HF generate,
               the engine step, acceptance and sampling statistics, the cluster with
               speculation and batching; the default pair against HF where its weights are
  models       the benchmarks' models: random-weight stand-ins of the catalog's shapes where
               the weights are not here (benchmarks/gpu_standins.py)
  bench-*      benchmarks/engine.py (the forward pass against the device's bandwidth), then
               attention_kernels (one layer's attention: the engine's padded SDPA against
               K/V expanded for the memory-efficient kernel and FlexAttention, and which SDPA
               backends take the call), then plain_decode and speculative (the cluster
               against HF generate), short

Imports only the standard library, so it runs before the bundle is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from . import gpu_bundle
from .gpu_stages import Stage, Summaries, run_stage

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "gpu-check"

TESTS = [
    "tests/unit/common/test_settings.py::test_settings_refuse_a_device_this_build_cannot_run",
    "tests/unit/engine/test_tree_attention.py",
    "tests/unit/engine/test_kv_cache.py",
    "tests/unit/engine/test_compile.py",
    "tests/unit/engine/test_step_counts.py",
    "tests/unit/speculation/test_speculative.py",
    "tests/unit/verifier/test_engine.py",
    "tests/unit/speculation/test_acceptance.py",
    "tests/unit/speculation/test_sampling_drops.py",
    # A cluster start costs ~20 s a case on an H200, so one case of each cluster test whose
    # parameters the in-process tests above already cover (the whole list took 395 s there).
    "tests/cluster/test_spec_cluster.py::test_concurrent_greedy_requests_equal_the_targets_output"
    "[hybrid-run-ahead]",
    "tests/cluster/test_spec_cluster.py::test_concurrent_greedy_requests_equal_the_targets_output"
    "[draft-tree]",
    "tests/cluster/test_spec_cluster.py::"
    "test_an_imperfect_draft_is_rejected_where_it_errs_and_the_output_stays_the_targets[tree]",
    "tests/cluster/test_serving.py::test_sequences_joining_and_leaving_mid_batch_keep_greedy_outputs"
    "[speculative]",
]
QUICK_TESTS = [
    "tests/unit/common/test_settings.py::test_settings_refuse_a_device_this_build_cannot_run",
    "tests/unit/engine/test_tree_attention.py",
    "tests/unit/verifier/test_engine.py::test_a_temperature_near_zero_is_greedy",
]
# Imports the bundle's wheels provide: one missing, and they are installed.
NEEDED_MODULES = (
    "grpc",
    "grpc_health",
    "pydantic_settings",
    "redis",
    "opentelemetry",
    "aiohttp",
    "pytest",
    "pytest_timeout",
)


class Check:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.bench = self.out / "bench"
        self.deadline = time.monotonic() + args.budget
        self.run_id = uuid.uuid4().hex[:8]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.results = {
            "device": args.device,
            "command": " ".join(["python -m benchmarks.gpu_check", *sys.argv[1:]]),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "budget_s": args.budget,
            "stages": [],
        }

    def prepare(self) -> None:
        """The package on the path; the bundle's parts where this machine lacks them."""
        pyroot = WORK / "pyroot"
        pyroot.mkdir(parents=True, exist_ok=True)
        link = pyroot / "specserve"
        if not link.exists():
            link.symlink_to(os.path.relpath(ROOT / "services", pyroot))
        paths = [str(WORK / "site"), str(pyroot), str(ROOT), os.environ.get("PYTHONPATH", "")]
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.results["bundle"] = gpu_bundle.place(self.env)

    def run(self, stage: Stage) -> None:
        left = self.deadline - time.monotonic()
        number = len(self.results["stages"]) + 1
        record = run_stage(stage, self.out, self.env, left, f"{self.run_id}:{number}", number)
        self.results["stages"].append(record)
        self.save()

    def save(self) -> None:
        stages = self.results["stages"]
        self.results["ok"] = bool(stages) and all(s["status"] == "passed" for s in stages)
        self.results["spent_s"] = round(self.args.budget - (self.deadline - time.monotonic()))
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")

    def missing_modules(self) -> list[str]:
        code = (
            "import importlib.util\n"
            f"print(' '.join(m for m in {NEEDED_MODULES!r} if importlib.util.find_spec(m) is None))"
        )
        found = subprocess.run(
            [sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60
        )
        return found.stdout.split()

    def stages(self) -> list[Stage]:
        py, device = sys.executable, self.args.device
        stages = []
        wheels = sorted(str(p) for p in (WORK / "bundle" / "wheels").glob("*.whl"))
        if wheels and self.missing_modules():
            install = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            install += ["--upgrade", "--target", str(WORK / "site"), *wheels]
            stages.append(Stage("bundle", install, 180))
        probe = [py, "-m", "benchmarks.gpu_probe", "--device", device]
        stages.append(Stage("environment", probe, 120, Summaries.probe))
        stages.append(self.tests())
        if not self.args.skip_bench:
            make = [py, "-m", "benchmarks.gpu_standins", "--device", device, "--out"]
            stages.append(Stage("models", [*make, str(WORK / "models")], 240, Summaries.json_lines))
            stages += self.benchmarks()
        return stages

    def tests(self) -> Stage:
        tests = list(self.args.tests or (QUICK_TESTS if self.args.quick else TESTS))
        if not self.args.tests and not self.args.quick and self.target_weights_here():
            tests.append("tests/cluster/test_default_model.py")  # the default pair against HF
        junit = str(self.out / "junit.xml")
        pytest = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
        pytest += ["-p", "pytest_timeout", "--timeout", "180", f"--junitxml={junit}", *tests]
        limit = 150 if self.args.quick else 330
        # Only the plugins named here: a machine's own (its image's pytest plugins, perhaps
        # built for another pytest than the bundle's) stay out of the run.
        env = {"SPECSERVE_TEST_DEVICE": self.args.device, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        return Stage("tests", pytest, limit, Summaries.junit(junit), env)

    def target_weights_here(self) -> bool:
        """Whether the models come from this machine's cache (not the bundle's, no weights)."""
        return not self.env.get("MODEL_CACHE_DIR", "").startswith(str(WORK))

    def benchmarks(self) -> list[Stage]:
        """Commands built when their stage starts, from the models stage's models.json."""
        quick, bench = self.args.quick, self.bench
        tokens = ["--tokens", "8" if quick else "64"]
        engine_parts = "decode,tree,ttft,batch" if quick else "decode,tiny,tree,ttft,batch"

        def engine() -> list[str]:
            use = self.models()
            parts = [p for p in engine_parts.split(",") if p not in use.get("missing", [])]
            command = self.bench_command("engine", "--label", f"gpu-check-{self.args.device}")
            command += [
                "--parts",
                ",".join(parts),
                "--reps",
                "3",
                "--steps",
                "8" if quick else "32",
            ]
            command += ["--threads", str(min(8, os.cpu_count() or 1))]
            return (
                command
                + self.model_flags(use, "target", "tiny")
                + ["--out", f"{bench}/engine.json"]
            )

        def attention() -> list[str]:  # one layer's attention, each SDPA backend and flex
            command = [sys.executable, "-m", "benchmarks.attention_kernels", "--quick"]
            command += ["--threads", "1", "--device", self.args.device, "--dtypes", "bfloat16"]
            return command + ["--no-recompiles", "--out", str(bench)]

        def plain() -> list[str]:
            use = self.models()
            command = self.bench_command("plain_decode", *tokens, "--out", str(bench))
            return command + self.model_flags(use, "target")

        def speculative() -> list[str]:
            use = self.models()
            command = self.bench_command("speculative", *tokens, "--out", str(bench))
            command += self.model_flags(use, "target", "draft") + ["--only", "chain 4"]
            if quick:
                return command + ["--kinds", "code", "--skip-hf"]
            return command + ["ngram 10", "--kinds", "code", "edit"]

        return [
            Stage("bench-engine", engine, 240, Summaries.bench(bench, "engine.json")),
            Stage(
                "bench-attention",
                attention,
                150,
                Summaries.bench(bench, "attention_kernels_quick.json"),
            ),
            Stage("bench-plain", plain, 200, Summaries.bench(bench, "plain_decode.json")),
            Stage(
                "bench-speculative", speculative, 300, Summaries.bench(bench, "speculative.json")
            ),
        ]

    def bench_command(self, module: str, *flags: str) -> list[str]:
        device = ["--device", self.args.device, "--dtype", "bfloat16"]
        return [sys.executable, "-m", f"benchmarks.{module}", *device, *flags]

    @staticmethod
    def models() -> dict:
        """The models stage's models.json: per role the stand-in to use (None: the catalog's
        model), and "missing": the roles with no model here at all."""
        path = WORK / "models" / "models.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @staticmethod
    def model_flags(use: dict, *roles: str) -> list[str]:
        return [a for role in roles if use.get(role) for a in (f"--{role}", use[role])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--budget", type=float, default=540, help="seconds for every stage together")
    p.add_argument("--quick", action="store_true", help="a few tests, 8-token benchmarks")
    p.add_argument("--tests", nargs="*", help="pytest node ids instead of the chosen subset")
    p.add_argument("--skip-bench", action="store_true", help="no stand-ins, no benchmarks")
    p.add_argument("--out", default=str(WORK / "results"))
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    Path(args.out).mkdir(parents=True)
    check = Check(args)
    check.prepare()
    stages = check.stages()
    print(f"[gpu-check] device {args.device}, {len(stages)} stages, budget {args.budget:.0f} s")
    for stage in stages:
        check.run(stage)
    check.save()
    failed = [s["name"] for s in check.results["stages"] if s["status"] != "passed"]
    print(f"[gpu-check] {'ok' if not failed else 'not ok: ' + ', '.join(failed)}")
    print(f"[gpu-check] results: {Path(args.out) / 'results.json'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
