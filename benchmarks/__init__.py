"""Benchmarks of specserve: each a `python -m benchmarks.<name>` that writes its results file."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(report: dict, out: str, name: str, shown: dict | None = None) -> Path:
    """Writes a benchmark's report to <out>/<name>.json and prints it (or `shown`, a part of
    it) and where it went."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report if shown is None else shown, indent=2))
    print(f"wrote {path}")
    return path
