"""The benchmarks' prompt sets, as rows of Spec-Bench's format ({question_id, category,
turns[, system]}), by name:

- `spec_bench`: Spec-Bench's 384 questions, 13 categories
  (`shared/workloads/spec_bench/question.jsonl`, hemingkx/Spec-Bench's data file).
- `code_edit`: code nobody here wrote, edited: module-level functions of the Python standard
  library that ships with the interpreter (`inspect.getsource`; 12-40 lines each, from
  EDIT_MODULES, in module and name order), each asked for one of three edits that copy most
  of the function back: `edit_type_hints` (annotate parameters and return), `edit_rename`
  (its first parameter renamed, every use with it), `edit_docstrings` (a docstring added). The
  i-th function takes the edit i mod 3, so no function appears twice. The source differs
  between Python versions: results name the interpreter.
- `agentic`: one tenant's requests sharing a tool schema (benchmarks.agentic's system message
  of three JSON Schema tools, and its requests in order), category `agentic`.
- `prompts`: the side-by-side benchmarks' three prompts (benchmarks.prompts: code generation,
  prose, a code edit), each its own category.

A path to a .jsonl file of such rows is a workload too. `rows("spec_bench,code_edit", n)`
takes the first n of every category of each, in order.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared/workloads/spec_bench/question.jsonl"
NAMES = ("spec_bench", "code_edit", "agentic", "prompts")

EDIT_MODULES = (
    "bisect", "calendar", "colorsys", "difflib", "fnmatch", "fractions", "heapq",
    "ipaddress", "posixpath", "shlex", "statistics", "textwrap", "urllib.parse",
)  # fmt: skip
EDITS = {
    "edit_type_hints": "Add type hints to every parameter and to the return value of this "
    "function from Python's `{module}` module. Change nothing else. Reply with the whole "
    "function in one Python code block.",
    "edit_rename": "Rename the parameter `{param}` of this function from Python's `{module}` "
    "module to `{new}`, and every use of it in the body. Change nothing else. Reply with the "
    "whole function in one Python code block.",
    "edit_docstrings": "Add a docstring to this function from Python's `{module}` module "
    "(replace its docstring if it has one): what it does, its parameters and what it returns. "
    "Change nothing else. Reply with the whole function in one Python code block.",
}
MIN_LINES, MAX_LINES = 12, 40


def rows(workload: str, per_category: int) -> list[dict]:
    """The first `per_category` rows of every category of each comma-separated workload."""
    chosen: list[dict] = []
    for name in workload.split(","):
        taken: dict[str, int] = defaultdict(int)
        for row in _all(name):
            if taken[row["category"]] < per_category:
                taken[row["category"]] += 1
                chosen.append(row)
    return chosen


def _all(name: str) -> list[dict]:
    if name == "spec_bench":
        return _jsonl(SPEC_BENCH)
    if name == "code_edit":
        return code_edits()
    if name == "agentic":
        from .agentic import ASKS, TOOLS

        return [
            {"question_id": f"agentic-{i}", "category": "agentic", "system": TOOLS, "turns": [a]}
            for i, a in enumerate(ASKS)
        ]
    if name == "prompts":
        from .prompts import PROMPTS

        return [
            {"question_id": f"prompt-{k}", "category": k, "turns": [t]} for k, t in PROMPTS.items()
        ]
    path = Path(name)
    if path.suffix == ".jsonl":
        return _jsonl(path)
    sys.exit(f"unknown workload {name!r}: name one of {', '.join(NAMES)}, or a .jsonl file")


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        hint = (
            ": put hemingkx/Spec-Bench's data/spec_bench/question.jsonl there"
            if path == SPEC_BENCH
            else ""
        )
        sys.exit(f"no workload file at {path}{hint} (or name another with --workload)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def code_edits() -> list[dict]:
    found = []
    for module_name in EDIT_MODULES:
        module = importlib.import_module(module_name)
        for name, fn in sorted(vars(module).items()):
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
            if MIN_LINES <= source.count("\n") <= MAX_LINES and params:
                found.append((module_name, name, source, params[0]))
    kinds = list(EDITS)
    out = []
    for i, (module_name, name, source, param) in enumerate(found):
        kind = kinds[i % len(kinds)]
        ask = EDITS[kind].format(module=module_name, param=param, new=f"{param}_value")
        out.append(
            {
                "question_id": f"{kind}-{module_name}.{name}",
                "category": kind,
                "turns": [f"{ask}\n\n```python\n{source}```"],
            }
        )
    return out


def messages(row: dict) -> list[dict]:
    """The row's first turn as chat messages (its system message first, if it has one)."""
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [*system, {"role": "user", "content": row["turns"][0]}]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "workload", nargs="?", default="code_edit", help=f"{', '.join(NAMES)}, or a path"
    )
    p.add_argument("--per-category", type=int, default=1000)
    args = p.parse_args()
    for row in rows(args.workload, args.per_category):
        print(json.dumps(row))
