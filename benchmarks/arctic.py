"""Arctic Inference's suffix cache (`arctic-inference` on PyPI, its CPU SuffixDecodingCache) as
a proposer of the acceptance benchmark, beside ours on the same target outputs.

Its suffix tree is C++ behind nanobind; the package's wheel brings vLLM and CUDA ops with it,
so only that part is built here, from the sdist (its sha256 checked against PyPI's index),
with nanobind (pip, into the build directory) and cmake, once, under
~/.cache/specserve/arctic/<version>/. `python -m benchmarks.arctic` builds it and prints where.

The proposer runs the cache as vLLM's suffix decoding does: a request's prompt starts it
(`start_request`), each step's new tokens extend it (`add_active_response`, which also feeds
the global tree of earlier responses that every later request matches), and a step's draft is
`speculate` on the last max_tree_depth tokens, with Arctic's defaults unless told otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

PACKAGE, VERSION = "arctic-inference", "0.3.0"
NANOBIND = "nanobind==2.9.2"  # the sdist's build requirement
HOME = Path.home() / ".cache" / "specserve" / "arctic" / VERSION
# SuffixDecodingCache.speculate's defaults (max_spec_factor, min_token_prob), its tree mode
# on: the benchmark's other proposers draft trees too.
MAX_TREE_DEPTH, SPEC_FACTOR, MIN_TOKEN_PROB = 64, 1.0, 0.1


class ArcticUnavailable(RuntimeError):
    """Arctic's suffix cache could not be fetched or built here: what to install."""


def _fetch_sdist(dest: Path) -> Path:
    index = f"https://pypi.org/pypi/{PACKAGE}/json"
    try:
        with urllib.request.urlopen(index, timeout=60) as r:
            files = json.load(r)["releases"][VERSION]
    except (OSError, KeyError) as e:
        raise ArcticUnavailable(f"cannot read {index} for {PACKAGE} {VERSION}: {e}") from e
    sdist = next(f for f in files if f["packagetype"] == "sdist")
    archive = dest / sdist["filename"]
    urllib.request.urlretrieve(urljoin(index, sdist["url"]), archive)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    if sha != sdist["digests"]["sha256"]:
        raise ArcticUnavailable(f"{archive.name}: sha256 {sha} is not the index's")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / archive.name.removesuffix(".tar.gz")


def build() -> Path:
    """The directory to put on sys.path for `arctic_inference.suffix_decoding`, built on
    first use."""
    package = HOME / "python" / "arctic_inference" / "suffix_decoding"
    if list(package.glob("_C*.so")):
        return HOME / "python"
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        raise ArcticUnavailable("building Arctic's suffix cache needs cmake and g++ (apt)")
    HOME.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HOME) as tmp:
        src = _fetch_sdist(Path(tmp))
        deps = HOME / "nanobind"
        run = [sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), NANOBIND]
        if subprocess.run(run).returncode:
            raise ArcticUnavailable(f"pip could not install {NANOBIND} (needs PyPI)")
        build_dir = Path(tmp) / "build"
        env = {**os.environ, "PYTHONPATH": str(deps)}  # (cmake asks nanobind where it is)
        print(f"building {PACKAGE} {VERSION}'s suffix tree (cmake, -j2)", flush=True)
        cmake = ["cmake", str(src / "csrc" / "suffix_decoding"), "-B", str(build_dir)]
        cmake += [f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
        try:
            subprocess.run(cmake, check=True, env=env)
            subprocess.run(["cmake", "--build", str(build_dir), "-j2"], check=True, env=env)
        except subprocess.CalledProcessError as e:
            raise ArcticUnavailable(f"building Arctic's suffix tree failed (above): {e}") from e
        shutil.rmtree(package.parent, ignore_errors=True)
        package.mkdir(parents=True)
        (package.parent / "__init__.py").write_text("")  # (not the wheel's: it imports vLLM)
        for name in ("__init__.py", "cache.py"):
            shutil.copy(src / "arctic_inference" / "suffix_decoding" / name, package / name)
        for built in build_dir.glob("_C*.so"):
            shutil.copy(built, package / built.name)
    return HOME / "python"


def suffix_cache_class():
    path = str(build())
    if path not in sys.path:
        sys.path.insert(0, path)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    return SuffixDecodingCache


class ArcticSuffix:
    """The acceptance benchmark's proposer interface over SuffixDecodingCache."""

    def __init__(self, depth: int = MAX_TREE_DEPTH):
        self.cache = suffix_cache_class()(max_tree_depth=depth)
        self.seen: dict[str, int] = {}  # tokens of each active request given to the cache
        self.ending: str | None = None

    def propose(self, jobs):
        from specserve.speculation.tree import DraftTree

        trees = []
        for job in jobs:
            tokens, seen = job.tokens, self.seen.get(job.seq_id)
            if seen is None:  # its first step: the prompt
                self.cache.start_request(job.seq_id, tokens)
            elif len(tokens) > seen:
                self.cache.add_active_response(job.seq_id, tokens[seen:])
            self.seen[job.seq_id] = len(tokens)
            draft = self.cache.speculate(
                job.seq_id,
                tokens[-self.cache.max_tree_depth :],
                max_spec_tokens=job.deep_budget or job.budget,
                max_spec_factor=SPEC_FACTOR,
                min_token_prob=MIN_TOKEN_PROB,
                use_tree_spec=True,
            )
            tree = DraftTree(model_free=True)
            for token, parent in zip(draft.token_ids, draft.parents, strict=True):
                tree.add(token, parent)
            trees.append(tree)
        return trees

    def forget(self, seq_id):
        self.ending = seq_id  # (stopped by learn, which has the last step's tokens)

    def learn(self, tenant, tokens, prompt_len):
        """The request ended with `tokens`: the last step's go into the cache (and its global
        tree of responses, as vLLM's would have added them), then it stops."""
        seq_id = self.ending
        seen = self.seen.pop(seq_id, None)
        if seen is not None:
            if len(tokens) > seen:
                self.cache.add_active_response(seq_id, tokens[seen:])
            self.cache.stop_request(seq_id)


if __name__ == "__main__":
    try:
        print(build())
    except ArcticUnavailable as e:
        raise SystemExit(str(e)) from e
