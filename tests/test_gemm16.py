"""gemm16: prefill's product with a 16-bit weight read as stored (``toolkit/cpu/gemm16.py``), against its spec
``x @ w.astype(f32).T`` (``toolkit/ref/qlinear.py`` on a dense format), as a table of shapes over both 16-bit kinds
and both lane widths, the tile's edges included (M and N not multiples of the 4 x 6 tile).

Tolerance: both sides multiply the same f32 values (widening f16 / bf16 is exact); only the order of the f32 sum
differs: a lane sums K / L products, then L lanes are added, so each output is within
``(K / L + L) * 2^-24 * sum_k |x_k w_k|`` of the exact sum, and so of the reference's. A wrong row, column, K
offset or widening is O(sum |x w|). The same bits at any thread count and input block size (each output is one
dot product in one order), and through qlinear's prefill path.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_close
from toolkit.cpu import gemm16, moe_gemm
from toolkit.cpu._jit import parallel_threshold
from toolkit.cpu.vec import max_lanes
from toolkit.formats import get_format
from toolkit.ops import get_op
from toolkit.threads import set_threads, threads

RNG = np.random.default_rng(16)
LANES = sorted({8, max_lanes()})
DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
# (M, N, K): one row, a tile's edges (M % 4, N % 6 not 0), a tile exactly, several blocks of 6 rows, long K;
# Mixtral's q|k|v rows at a short prompt
SHAPES = [(1, 1, 16), (1, 7, 32), (3, 5, 16), (4, 6, 64), (5, 13, 48), (11, 24, 128), (9, 6, 1024), (64, 48, 4096)]


def case(M, N, K, kind):
    x = RNG.standard_normal((M, K)).astype(np.float32)
    w = (RNG.standard_normal((N, K)) * 0.05).astype(DTYPES[kind])
    return x, w


def within_bound(got, x, w, L, what):
    wf = w.astype(np.float32)
    want = x.astype(np.float64) @ wf.T.astype(np.float64)
    K = x.shape[1]
    bound = (K / L + L) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(wf).T.astype(np.float64))
    err = np.abs(got.astype(np.float64) - want)
    assert got.shape == want.shape and got.dtype == np.float32, what
    assert (err <= bound).all(), f"{what}: worst {(err / np.maximum(bound, 1e-30)).max():.2f} of the bound"


@pytest.mark.parametrize("L", LANES)
@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_gemm16_against_spec(M, N, K, kind, L):
    x, w = case(M, N, K, kind)
    if K % L:
        pytest.skip(f"K={K} is not a multiple of {L} lanes (such K take the tiled path)")
    got = gemm16.gemm16(x, w.view(np.uint16), kind, L)
    within_bound(got, x, w, L, f"gemm16 {kind} L={L} {M}x{N}x{K}")


@pytest.mark.parametrize("kind", list(DTYPES))
def test_gemm16_same_bits_at_any_thread_count_and_block(kind, monkeypatch):
    x, w = case(37, 61, 256, kind)
    serial = gemm16.gemm16(x, w.view(np.uint16), kind)
    was = threads()
    try:
        set_threads(min(2, was) if was > 1 else 1)
        with parallel_threshold(0):  # the parallel build, whatever the work
            par = gemm16.gemm16(x, w.view(np.uint16), kind)
    finally:
        set_threads(was)
    monkeypatch.setattr(gemm16, "X_BLOCK_BYTES", 4 * 256 * 4)  # blocks of 4 input rows
    blocked = gemm16.gemm16(x, w.view(np.uint16), kind)
    assert_close(par, serial, exact=True, what="parallel build")
    assert_close(blocked, serial, exact=True, what="4-row input blocks")


@pytest.mark.parametrize("spec", ["f16", "bf16"])
def test_qlinear_prefill_reads_16_bit_weights_directly(spec, monkeypatch):
    """A 16-bit weight over more rows than the GEMV takes: gemm16 on its stored bits, never a widened tile."""
    w = get_format(spec).quantize(RNG.standard_normal((30, 128)).astype(np.float32), "numpy")
    x = RNG.standard_normal((20, 128)).astype(np.float32)
    monkeypatch.setattr(moe_gemm, "tiles_times", lambda *a: pytest.fail("a 16-bit weight took the widened tiles"))
    got = get_op("qlinear", "numba")(x, w)
    direct = gemm16.gemm16(x, w.arrays["weight"].view(np.uint16), spec)
    assert_close(got, direct, exact=True, what=f"qlinear {spec}")
    within_bound(got, x, w.arrays["weight"], max_lanes(), f"qlinear {spec}")


def test_other_k_take_the_tiled_path():
    """K not a multiple of the lanes: a clear refusal from gemm16 itself, and qlinear takes the widened tiles."""
    x, w = case(3, 5, 40, "f16")
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm16.gemm16(x, w.view(np.uint16), "f16", 16)
    qt = get_format("f16").quantize(RNG.standard_normal((9, 40)).astype(np.float32), "numpy")
    xs = RNG.standard_normal((12, 40)).astype(np.float32)
    within_bound(get_op("qlinear", "numba")(xs, qt), xs, qt.arrays["weight"], 1, "qlinear f16 K=40")  # any order


@pytest.mark.parametrize("L", LANES)
def test_gemm16_inner_loop(L):
    """The K loop is the register tile it is written to be: 24 full-width FMAs, the weight widened by vcvtph2ps,
    and at 16 lanes no accumulator spilled to the stack."""
    from test_cpu_asm import fma_loop

    loop = fma_loop(gemm16.assembly("f16", L))
    fmas = [x for x in loop if re.match(r"vfmadd\d+ps\s", x)]
    reg = "%zmm" if L == 16 else "%ymm"
    assert len(fmas) == 24 and all(reg in x for x in fmas), "\n".join(loop)
    assert sum(x.startswith("vcvtph2ps") for x in loop) == 6, "\n".join(loop)
    if L == 16:
        spills = [x for x in loop if "(%rsp)" in x]
        assert not spills, "accumulators spilled:\n" + "\n".join(spills)
