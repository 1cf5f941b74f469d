"""The engine's int4 CPU kernel (engine/kernels): its layout, its instruction paths, and
what speculation needs of it (an output row depends on its own activation row alone)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine import kernels, quant

pytestmark = pytest.mark.skipif(
    not kernels.cpu_supported(), reason="the kernel is for x86 CPUs with AVX2"
)


def packed(out: int, inputs: int, seed: int = 0):
    """Random weights as the kernel takes them, and the float32 weights they encode."""
    gen = torch.Generator().manual_seed(seed)
    codes, scales, offsets = quant.int4_codes(torch.randn(out, inputs, generator=gen) * 0.05)
    scales, offsets = scales.to(torch.bfloat16), offsets.to(torch.bfloat16)
    weights = quant.int4_dequantized(codes, scales.float(), offsets.float())
    return (*kernels.int4_blocks(codes, scales, offsets), weights)


@pytest.fixture(scope="module", autouse=True)
def built():
    kernels.load()


@pytest.mark.parametrize("out,inputs", [(40, 256), (37, 256), (300, 1536), (96, 2304)])
def test_the_product_is_the_encoded_weights_times_the_activations(out, inputs):
    codes, scale_offset, weights = packed(out, inputs)
    x = torch.randn(9, inputs, generator=torch.Generator().manual_seed(1))
    exact = x @ weights.t()
    y = kernels.int4_mm(x, codes, scale_offset)
    # what is left is the activations' rounding to int8 (a step of max|x| / 127 a group)
    assert (y - exact).abs().max() <= 0.01 * exact.abs().max()


@pytest.mark.parametrize(
    "out,inputs,dtype",
    [(37, 256, torch.float32), (300, 1536, torch.bfloat16), (20, 200, torch.float32)],
)
def test_the_kernels_quantiser_writes_the_bits_of_the_reference_layout(out, inputs, dtype):
    """int4_quantize (C++, one pass) against quant.int4_codes + kernels.int4_blocks (torch's
    ops), inputs padded with zero weights to whole blocks; groups that are flat or all zero
    included."""
    w = (torch.randn(out, inputs, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype)
    w[0], w[1, :64] = 0.0, 0.25
    padded = torch.nn.functional.pad(w.float(), (0, -inputs % kernels.BLOCK_INPUTS))
    codes, scales, offsets = quant.int4_codes(padded)
    want = kernels.int4_blocks(codes, scales.to(torch.bfloat16), offsets.to(torch.bfloat16))
    got = kernels.int4_quantize(w)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))


def test_every_row_count_gives_each_row_the_value_it_has_alone():
    """1 to 21 rows, through every path this CPU runs: every tiling of the rows (4 or 8 at a
    time, by the path, and the rest; tiles of more than 4 rows in spans of 8 blocks, their sums
    kept between spans) leaves each output bit for bit what its row gives alone."""
    codes, scale_offset, _ = packed(71, 4608)  # (an odd count: rows in pairs, and one alone)
    x = torch.randn(21, 4608, generator=torch.Generator().manual_seed(2))  # (18 blocks)
    for path in kernels.int4_paths():
        alone = torch.cat(
            [kernels.int4_mm_path(x[i : i + 1], codes, scale_offset, path) for i in range(21)]
        )
        for rows in range(1, 22):
            y = kernels.int4_mm_path(x[:rows], codes, scale_offset, path)
            assert torch.equal(y, alone[:rows]), (path, rows)


def test_every_path_gives_the_same_bits():
    """Where the CPU has AVX512-VNNI int4_mm may multiply bytes with dpbusd on 512-bit or
    256-bit registers, where it has AMX-INT8 with tdpbusd on tiles, elsewhere with maddubs;
    all sum the same integers exactly and scale them in the same order. 130 weight rows: 8
    strips of 16 on AMX's tiles and 2 rows through 512-bit VNNI; 10 blocks of inputs: tiles of
    more than 4 rows take them in two spans."""
    codes, scale_offset, _ = packed(130, 2560)
    x = torch.randn(40, 2560, generator=torch.Generator().manual_seed(3)) * 3
    x[0, :64] = 0  # whole zero groups (scale 0)
    x[1, 5] = 1e4  # one large value: the rest of its group rounds to 0
    avx2 = kernels.int4_mm_path(x, codes, scale_offset, "avx2")
    assert torch.isfinite(avx2).all()
    assert torch.equal(kernels.int4_mm(x, codes, scale_offset), avx2)
    runs = kernels.int4_paths()
    for path in kernels.PATHS:
        if path in runs:
            for rows in (1, 4, 5, 6, 8, 9, 11, 16, 17, 40):  # (tiles of 4, 8 or 16, the rest)
                y = kernels.int4_mm_path(x[:rows], codes, scale_offset, path)
                assert torch.equal(y, avx2[:rows]), (path, rows)
        else:
            with pytest.raises(RuntimeError, match="this CPU has no (AVX512-VNNI|AMX-INT8)"):
                kernels.int4_mm_path(x, codes, scale_offset, path)


def test_the_path_by_rows_is_measured_and_moves_no_bit():
    """choose_int4_path times every path on a layer and sets which one calls of each row count
    take; whatever is set, every row count gives the bits of the AVX2 path."""
    ops = torch.ops.specserve
    codes, scale_offset, _ = packed(2048, 1536)
    before = ops.int4_paths_set()
    chosen = kernels.choose_int4_path([(codes, scale_offset)])
    assert set(chosen) == set(kernels.PATH_PROBE_ROWS)
    assert set(chosen.values()) <= set(kernels.int4_paths())
    set_by_rows = [kernels.PATHS[p] for p in ops.int4_paths_set()]
    assert set_by_rows[0] == chosen[1] and set_by_rows[7] == chosen[8]
    assert set_by_rows[15] == chosen[16] and set_by_rows[16] == chosen[16]
    assert set_by_rows[23] == chosen[24] and set_by_rows[-1] == chosen[64]
    x = torch.randn(18, 1536, generator=torch.Generator().manual_seed(4))
    reference = kernels.int4_mm_path(x, codes, scale_offset, "avx2")
    numbers = list(ops.int4_paths())
    try:
        for paths in (numbers, numbers[::-1], [numbers[-1], numbers[0]]):
            ops.int4_set_paths(paths)
            for n in (1, 2, 3, 4, 9, 18):
                assert torch.equal(kernels.int4_mm(x[:n], codes, scale_offset), reference[:n])
        with pytest.raises(RuntimeError, match="no paths"):
            ops.int4_set_paths([])
        with pytest.raises(RuntimeError, match="does not run path 7"):
            ops.int4_set_paths([7])
    finally:
        ops.int4_set_paths(before)


def test_the_paths_to_time_may_be_named(monkeypatch):
    """SPECSERVE_INT4_PATHS leaves out the paths it does not name (to compare a service with
    and without one); a name that is no path, or none this CPU runs, is refused by name."""
    ops = torch.ops.specserve
    codes, scale_offset, _ = packed(64, 256)
    before = ops.int4_paths_set()
    try:
        monkeypatch.setenv("SPECSERVE_INT4_PATHS", "avx2")
        chosen = kernels.choose_int4_path([(codes, scale_offset)], reps=1)
        assert set(chosen.values()) == {"avx2"}
        assert set(ops.int4_paths_set()) == {kernels.PATHS.index("avx2")}
        monkeypatch.setenv("SPECSERVE_INT4_PATHS", "avx2, sse")
        with pytest.raises(kernels.KernelError, match=r"names no path \['sse'\]"):
            kernels.choose_int4_path([(codes, scale_offset)], reps=1)
    finally:
        ops.int4_set_paths(before)


def test_shapes_that_disagree_are_refused_by_name():
    codes, scale_offset, _ = packed(8, 256)
    with pytest.raises(RuntimeError, match="int4_mm: shapes disagree"):
        kernels.int4_mm(torch.randn(2, 512), codes, scale_offset)
    with pytest.raises(RuntimeError, match="int4_mm: x must be a 2-D float32"):
        kernels.int4_mm(torch.randn(2, 256).double(), codes, scale_offset)


def test_a_killed_builds_lock_does_not_stop_the_next_build():
    """A build killed mid-way leaves torch's `lock` file in the build directory, on which
    torch's next build waits forever: the kernels' own lock (let go by the system when its
    holder dies) shows it stale, and the next build removes it and goes on."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(kernels.NAME, verbose=False))
    (build_dir / "lock").touch()
    load = "from specserve.engine import kernels; kernels.load(); print('loaded')"
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert not (build_dir / "lock").exists()
