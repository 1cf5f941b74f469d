"""Benchmarks of specserve: each a `python -m benchmarks.<name>` that writes its results file."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

CPU_FEATURES = ("avx2", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")  # Linux's names


def machine() -> str:
    """The machine a result was measured on: architecture, cores, and on Linux the CPU's model
    name and which of CPU_FEATURES it has (the engine's kernels differ by them)."""
    label = f"{platform.machine()}, {os.cpu_count()} cores"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return label

    def field(key: str) -> str:
        return next((li.split(":", 1)[1].strip() for li in lines if li.startswith(key)), "")

    name, flags = field("model name"), field("flags").split()
    have = " ".join(f for f in CPU_FEATURES if f in flags)
    return f"{label}, {name} ({have})" if name else label


def write_results(report: dict, out: str, name: str, shown: dict | None = None) -> Path:
    """Writes a benchmark's report to <out>/<name>.json and prints it (or `shown`, a part of
    it) and where it went."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report if shown is None else shown, indent=2))
    print(f"wrote {path}")
    return path
