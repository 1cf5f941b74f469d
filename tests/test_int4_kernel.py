"""The engine's int4 CPU kernel (engine/kernels): its layout, its two instruction paths, and
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


def test_every_row_count_gives_each_row_the_value_it_has_alone():
    """1 to 21 rows: every tiling of the rows (4 at a time, the rest 3, 2 or 1; spans of blocks
    shorter as rows grow) leaves each output bit for bit what its row gives alone."""
    codes, scale_offset, _ = packed(71, 2048)  # (an odd count: rows in pairs, and one alone)
    x = torch.randn(21, 2048, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kernels.int4_mm(x[i : i + 1], codes, scale_offset) for i in range(21)])
    for rows in range(1, 22):
        assert torch.equal(kernels.int4_mm(x[:rows], codes, scale_offset), alone[:rows]), rows


def test_the_avx2_path_and_the_vnni_one_give_the_same_bits():
    """Where the CPU has AVX512-VNNI int4_mm may multiply bytes with dpbusd, elsewhere with
    maddubs; both sum the same integers exactly."""
    ops = torch.ops.specserve
    codes, scale_offset, _ = packed(130, 1280)
    x = torch.randn(6, 1280, generator=torch.Generator().manual_seed(3)) * 3
    x[0, :64] = 0  # whole zero groups (scale 0)
    x[1, 5] = 1e4  # one large value: the rest of its group rounds to 0
    avx2 = ops.int4_mm_avx2(x, codes, scale_offset)
    assert torch.isfinite(avx2).all()
    assert torch.equal(kernels.int4_mm(x, codes, scale_offset), avx2)
    if ops.int4_vnni():
        assert torch.equal(ops.int4_mm_vnni(x, codes, scale_offset), avx2)
    else:
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            ops.int4_mm_vnni(x, codes, scale_offset)


def test_the_path_by_rows_is_measured_and_moves_no_bit():
    """choose_int4_path times both paths on a layer and sets from how many rows a call takes
    VNNI; whatever it sets, every row count gives the bits of the AVX2 path."""
    ops = torch.ops.specserve
    codes, scale_offset, _ = packed(2048, 1536)
    rows = kernels.choose_int4_path(codes, scale_offset)
    if ops.int4_vnni():
        assert rows in (*kernels.PATH_PROBE_ROWS, kernels.PATH_PROBE_ROWS[-1] + 1)
    else:
        assert rows is None
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(4))
    reference = ops.int4_mm_avx2(x, codes, scale_offset)
    try:
        for threshold in (1, 3, 10):
            ops.int4_set_vnni_min_rows(threshold)
            for n in (1, 2, 3, 4, 9):
                assert torch.equal(kernels.int4_mm(x[:n], codes, scale_offset), reference[:n])
        with pytest.raises(RuntimeError, match="at least 1"):
            ops.int4_set_vnni_min_rows(0)
    finally:
        ops.int4_set_vnni_min_rows(rows or 1)


def test_shapes_that_disagree_are_refused_by_name():
    codes, scale_offset, _ = packed(8, 256)
    with pytest.raises(RuntimeError, match="int4_mm: shapes disagree"):
        kernels.int4_mm(torch.randn(2, 512), codes, scale_offset)
    with pytest.raises(RuntimeError, match="int4_mm: x must be a 2-D float32"):
        kernels.int4_mm(torch.randn(2, 256).double(), codes, scale_offset)
