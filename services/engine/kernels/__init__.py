"""The engine's own CPU kernels, built from C++ on first use with torch's extension builder
(into torch's extension cache: ~/.cache/torch_extensions, rebuilt when a source changes).

- `int4_cpu.cpp` (its loops in `int4_rows.inc`): `torch.ops.specserve.int4_mm`, int4 weights
  (groups of 32, a bfloat16 scale and offset each) times float32 activations quantised per
  group to int8, on x86 CPUs with AVX2 and FMA, with AVX512-VNNI's byte dot products on 512-
  or 256-bit registers where the CPU has them, and AMX-INT8's tiles for calls of many rows
  (`int4_mm_path` runs one path, for the tests and for `choose_int4_path`'s timing).
  `quant.Int4Linear` uses it on such CPUs; elsewhere torch's int4 kernels.
- `layer_cpu.cpp`: a decoder layer's small float32 ops as one op each (`rms_norm`,
  `rotary`; layers.CpuOps), and `int4_quantize`, which writes int4_mm's layout from float
  weights.
- `attention_cpu.cpp`: `paged_attention`, attention that reads each sequence's KV in place
  through its slots (attention.attend_paged).
- `layers_cpu.cpp`: `int4_layers`, every decoder layer of a step (int4 projections) as one op
  over the kernels above and ATen's (layers.Int4Layers).
- `select_cpu.cpp`: `argmax_rows`, torch.argmax over the vocabulary streamed with AVX2
  (greedy selection; `argmax`), and `greedy_rows`, the same with the finite check of the
  logits in the pass (`greedy_rows`); sampling's passes over the vocabulary,
  `softmax_weights` and `draw_rows` (`softmax_weights`, `draw`).

`python -m specserve.engine.kernels` builds them (`make setup` does, so no service start
waits on a compiler) and prints what was built. Builds take turns under a lock the system
lets go of when its holder dies, so a killed build stops no later one (`_builder`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "int4_cpu.cpp",
        "layer_cpu.cpp",
        "attention_cpu.cpp",
        "layers_cpu.cpp",
        "select_cpu.cpp",
    )
]
# (torch's builder hashes SOURCES only)
INCLUDED = [
    Path(__file__).with_name(name) for name in ("int4_rows.inc", "int4_amx.inc", "simd_exp.h")
]
GROUP = 32  # inputs per int4 scale/offset pair
BLOCK_GROUPS = 8  # groups per block of the int4 layout
BLOCK_INPUTS = GROUP * BLOCK_GROUPS
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # openmp: at::parallel_for's pragmas
NAME = "specserve_kernels"  # torch's extension (and build directory) name
# The revision of paged_attention's rounding, in the served version of a CPU verifier that
# runs it (models.served_version): 2 since its scores are summed 8 entries at a time (before,
# one at a time, the served version's kind was plain `cpu`).
PAGED_ATTENTION_ROUNDING = 2


def _digest(paths: list[Path]) -> str:
    """A short hash of files the sources include: in the build's flags, so that a change to
    one of them rebuilds the kernels as a change to a source does."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _builder(build_dir: Path):
    """Held while the kernels are built or loaded: an exclusive lock on `build.flock` in the
    build directory, which the system lets go when its holder dies. Under it, torch's own
    marker of a build in progress (`lock`, a plain file) is a killed build's, never removed,
    on which every later build would wait forever: it is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing a killed kernels build's lock", extra={"path": str(stale)})
            stale.unlink(missing_ok=True)
        yield


class KernelError(RuntimeError):
    """The engine's CPU kernels cannot be built or run on this host."""


def cpu_supported() -> bool:
    """Whether this host runs the kernels: x86 with AVX2 (FMA comes with every AVX2 CPU
    torch supports)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load() -> None:
    """Builds (once per source version) and loads the kernels into torch.ops.specserve;
    raises KernelError naming what is missing."""
    if not cpu_supported():
        raise KernelError(
            f"the int4 CPU kernel needs AVX2; this CPU's capability is "
            f"{torch.backends.cpu.get_cpu_capability()}"
        )
    from torch.utils import cpp_extension

    start = time.monotonic()
    try:
        with _builder(Path(cpp_extension._get_build_directory(NAME, verbose=False))):
            cpp_extension.load(
                name=NAME,
                sources=[str(s) for s in SOURCES],
                extra_cflags=[*FLAGS, f"-DSPECSERVE_INCLUDED={_digest(INCLUDED)}"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, no ninja, a build error
        raise KernelError(f"building the engine's CPU kernels failed: {e}") from e

    @torch.library.register_fake("specserve::int4_mm")
    def _(x, codes, scale_offset):  # the output's shape, for tracing (torch.compile)
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("specserve::int4_mm_path")
    def _(x, codes, scale_offset, path):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("specserve::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("specserve::rotary")
    def _(x, cos, sin):
        return torch.empty_like(x)

    @torch.library.register_fake("specserve::paged_attention")
    def _(q, keys, values, slots, mask, query_rows, scale):
        return torch.empty_like(q)

    log.info("engine CPU kernels loaded", extra={"seconds": round(time.monotonic() - start, 1)})


PATHS = ("avx2", "vnni256", "vnni512", "amx")  # int4_mm's instruction paths, by their number
# Row counts choose_int4_path times: 5 too, one past AVX2's largest tile (4 rows; the VNNI
# paths' tiles take up to 8), so that calls of 5-7 rows take the path fastest there; past 16
# (AMX's tiles), counts that are compute-bound and timed on every LARGE_SAMPLE-th layer alone.
# The last also stands for every larger call (prompt chunks).
PATH_PROBE_ROWS = (1, 2, 4, 5, 8, 16, 24, 32, 64)
LARGE_SAMPLE = 8


def choose_int4_path(
    layers: list[tuple[torch.Tensor, torch.Tensor]], reps: int = 2
) -> dict[int, str]:
    """Times every int4 path this CPU runs at PATH_PROBE_ROWS, each a pass over all of
    `layers` ((codes, scale_offset) of a model's int4 layers: streamed from memory, as a
    forward streams them, past the caches of a large model), the best of `reps`, and has
    int4_mm take the fastest at each count for calls from that count up to the next
    (PATH_PROBE_ROWS[-1]: it and every larger call); returns {rows: path name}. The paths give
    the same bits, so this moves only time: on an AMD EPYC the default target's LM head at one
    row streamed 1.5x faster through AVX2 than through 512-bit VNNI (decode 17.8 -> 25.2
    tokens/s), and a 16-node tree took 1.3x longer; on a Xeon the MLP layers streamed 3-8%
    faster through 256-bit VNNI at 1-4 rows and the LM head through 512-bit, and a pass of
    the default target's layers at 32 rows took 215 ms on AMX's tiles against 273 through
    512-bit VNNI (24 rows: 207 and 191). SPECSERVE_INT4_PATHS (names, comma-separated) leaves
    out the paths it does not name, to compare them in a whole service."""
    ops = torch.ops.specserve
    paths = list(ops.int4_paths())
    if named := os.environ.get("SPECSERVE_INT4_PATHS"):
        asked = {name.strip() for name in named.split(",")}
        if unknown := asked - set(PATHS):
            raise KernelError(
                f"SPECSERVE_INT4_PATHS names no path {sorted(unknown)}; paths: {PATHS}"
            )
        paths = [p for p in paths if PATHS[p] in asked]
        if not paths:
            raise KernelError(f"SPECSERVE_INT4_PATHS={named}: this CPU runs none of them")
    g = torch.Generator().manual_seed(0)
    inputs = {codes.shape[1] * 2 for codes, _ in layers}

    def best(path: int, rows: int, xs: dict[int, torch.Tensor]) -> float:
        timed = layers if rows <= 16 else layers[::LARGE_SAMPLE]
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            for codes, scale_offset in timed:
                ops.int4_mm_path(xs[codes.shape[1] * 2], codes, scale_offset, path)
            times.append(time.perf_counter() - started)
        return min(times)

    fastest = {}
    for rows in PATH_PROBE_ROWS:
        xs = {n: torch.randn(rows, n, generator=g) for n in inputs}
        fastest[rows] = min(paths, key=lambda path, rows=rows, xs=xs: best(path, rows, xs))
    by_rows = range(1, PATH_PROBE_ROWS[-1] + 1)  # (int4_cpu.cpp's table: kTable entries)
    ops.int4_set_paths([fastest[max(r for r in PATH_PROBE_ROWS if r <= n)] for n in by_rows])
    return {rows: PATHS[path] for rows, path in fastest.items()}


def int4_mm_path(
    x: torch.Tensor, codes: torch.Tensor, scale_offset: torch.Tensor, path: str
) -> torch.Tensor:
    """int4_mm through one named path (PATHS); a path this CPU does not run raises."""
    return torch.ops.specserve.int4_mm_path(x, codes, scale_offset, PATHS.index(path))


def int4_paths() -> list[str]:
    """The paths this CPU runs."""
    return [PATHS[p] for p in torch.ops.specserve.int4_paths()]


def int4_blocks(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] in 0..15 and scales, offsets [out, in / GROUP] bfloat16 (in a multiple
    of BLOCK_INPUTS) -> int4_mm's layout: packed codes [out, in / 2] uint8 and scale_offset
    [out, in / BLOCK_INPUTS, 2 * BLOCK_GROUPS] bfloat16 (a block's scales, then its offsets).

    A block's 256 codes are four rows of 32 bytes; row i holds step 2i in its low nibbles and
    step 2i + 1 in its high ones, and a step is codes 4s..4s+3 of each of the block's 8 groups
    in turn (int4_cpu.cpp)."""
    out, inputs = codes.shape
    blocks = inputs // BLOCK_INPUTS
    steps = codes.reshape(out, blocks, BLOCK_GROUPS, 8, 4).transpose(2, 3)  # [.., step, group, 4]
    pairs = steps.reshape(out, blocks, 4, 2, 32).to(torch.uint8)
    packed = (pairs[:, :, :, 0] | pairs[:, :, :, 1] << 4).reshape(out, inputs // 2)
    shape = (out, blocks, BLOCK_GROUPS)
    return packed, torch.cat([scales.reshape(shape), offsets.reshape(shape)], dim=-1)


@functools.cache
def available() -> bool:
    """Whether the kernels run here (built and loaded; once per process)."""
    if not cpu_supported():
        return False
    try:
        load()
    except KernelError as e:
        log.warning("the engine's CPU kernels did not load", extra={"error": str(e)})
        return False
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of a 2-D tensor, through argmax_rows for float32 on a CPU where the
    kernels run (the same indices: the first of the largest value, or of the first NaN)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and available():
        return torch.ops.specserve.argmax_rows(x)
    return x.argmax(-1)


def greedy_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[rows] int64 of a 2-D float32 tensor on a CPU where the kernels run: each row's argmax
    (as `argmax`), or -1 where the row holds a NaN or an inf, in one pass over x; None for any
    other tensor (its caller then takes torch's ops)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and available():
        return torch.ops.specserve.greedy_rows(x)
    return None


def softmax_weights(
    x: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """exp(x[rows[i]] / temperature[i] - its maximum) for each i, unnormalised ([P, vocab]; 0
    where more than 87.3 below the maximum, -inf included), and each row's sum ([P]): two
    passes over each chosen row of x [R, vocab] float32 on a CPU where the kernels run, read in
    place; None for any other x. rows int64 [P], temperature float32 [P] (> 0)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and available():
        return torch.ops.specserve.softmax_weights(x, rows, temperature)
    return None


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """[S] int64: from each row of non-negative weights [S, vocab] (any sum), the first token
    whose cumulative weight exceeds u[i] (uniform in [0, 1), float32 [S]) times the row's
    total; never a token of weight 0 (0 for a row of zeros). On a CPU where the kernels run;
    None for any other tensor."""
    if weights.dtype == torch.float32 and weights.device.type == "cpu" and available():
        return torch.ops.specserve.draw_rows(weights, u)
    return None


def int4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float32 or bfloat16 on the CPU -> (packed, scale_offset) in int4_mm's
    layout, the inputs padded with zero weights to whole blocks: the bits of
    `int4_blocks(*quant.int4_codes(padded weight))` with the scales and offsets in bfloat16,
    computed in one pass in C++ (layer_cpu.cpp; the default target's layers in about 3.5 s here
    against 13.5 s through torch's ops)."""
    return torch.ops.specserve.int4_quantize(weight)


def int4_mm(x: torch.Tensor, codes: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """[rows, in] float32 @ int4 weights in int4_blocks' layout -> [rows, out] float32; `in`
    may stop short of the weights' inputs by their zero padding (whole groups)."""
    return torch.ops.specserve.int4_mm(x, codes, scale_offset)
