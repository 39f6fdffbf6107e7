"""The CUDA kernels of cuda_src/, run on the CPU through cuda_src/emu (toolkit.gpu.emulate), against the NumPy
reference. Every case runs with a block's threads in forward and in reverse order (a missing __syncthreads
shows in one of them); launchers (toolkit/gpu/<op>.py run_<op>) are exercised as they are on a GPU.
Tolerances: exact for routing ids, align layouts and fp8 codes/scales; F32_TOL for reductions summed in a
different order; GEMM_TOL for K-long dot products (the kernels fuse multiply-adds).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_close
from toolkit.errors import BackendError
from toolkit.formats import get_format
from toolkit.formats.fp8 import fp8_act_quant_ref
from toolkit.gpu import emulate
from toolkit.gpu.fp8_act_quant import run_fp8_act_quant
from toolkit.gpu.fused_moe import run_fused_moe
from toolkit.gpu.launch import EmuRunner
from toolkit.gpu.moe_align import run_moe_align
from toolkit.gpu.moe_combine import run_moe_combine
from toolkit.gpu.moe_gemm import DECODERS, run_moe_gemm
from toolkit.gpu.rms_norm import run_rms_norm
from toolkit.gpu.silu_and_mul import run_silu_and_mul
from toolkit.gpu.topk_softmax import run_topk_softmax
from toolkit.ops import get_op

RNG = np.random.default_rng(0)
F32_TOL = dict(atol=2e-6, rtol=2e-5)
GEMM_TOL = dict(atol=2e-5, rtol=2e-5)
# W8A8 after a GEMM: GEMM1's last-ulp differences can move an activation across an e4m3 rounding boundary
# in GEMM2 (one code = 1/8 relative), so the fused fp8 pipeline gets a bound of a few such flips.
FUSED_TOL = {"fp8": dict(atol=1e-2, rtol=1e-2)}
CASES = Path(__file__).with_name("cuda")

# (T, E, A): one token, top-k = E, top-1, Mixtral 8/2, Qwen-style 60/4, DeepSeek-size 256/8
ROUTER_SHAPES = [(1, 8, 2), (7, 4, 4), (16, 8, 1), (64, 8, 2), (5, 60, 4), (3, 256, 8)]
# (T, E, A, block_m): one token, experts without tokens, all slots to few experts, big blocks, many experts
ALIGN_SHAPES = [(1, 8, 2, 16), (7, 4, 4, 16), (37, 8, 2, 16), (300, 8, 2, 64), (5, 60, 4, 16), (3, 16, 2, 64), (600, 4, 1, 16)]
# [T, 2I]
SILU_SHAPES = [(1, 16), (9, 2000), (3, 2050)]
# (T, A, D)
COMBINE_SHAPES = [(1, 2, 8), (5, 4, 300), (7, 1, 33)]
# [T, K]
ACT_SHAPES = [(1, 32), (5, 1000), (3, 4096)]
# [T, D]
NORM_SHAPES = [(1, 8), (5, 256), (7, 4096)]
# (T, E, A, N, K): decode (1 token), top-k = E, experts with no token, prefill-ish (many slots per expert)
GEMM_SHAPES = [(1, 8, 2, 40, 128), (3, 4, 4, 64, 256), (5, 16, 2, 72, 128), (24, 4, 2, 48, 128)]
GEMM_FORMATS = ["int8", "fp8", "int4", "int3", "int2", "q8_0", "q4_0", "int4-g32", "int3-g128"]
GEMM_KINDS = [("splitk", 16), ("tiled", 16), ("tiled", 64)]
TC_SHAPES = [(3, 4, 4, 64, 256), (24, 4, 2, 48, 128)]  # the sm_80 tensor-core path: a few rows (slow to emulate)
TC_FORMATS = ["int8", "fp8", "int3", "q4_0"]


@pytest.fixture(params=["forward", "reverse"])
def rt(request):
    return EmuRunner(reverse=request.param == "reverse")


def routing(T, E, A):
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)  # [T, A]
    return ids, RNG.random((T, A)).astype(np.float32)


@pytest.mark.parametrize("shape", ROUTER_SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax(rt, shape, renormalize):
    T, E, A = shape
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    wr, ir = get_op("topk_softmax", "numpy")(logits, A, renormalize)
    w, ids = run_topk_softmax(rt, logits, A, renormalize)
    assert_close(ids, ir, exact=True, what="expert ids")
    assert_close(w, wr, **F32_TOL, what="routing weights")


def test_topk_softmax_ties_pick_lower_id(rt):
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0] * 5], np.float32)
    w, ids = run_topk_softmax(rt, logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert_close(w, np.full((2, 2), 0.5, np.float32), atol=1e-7)


@pytest.mark.parametrize("shape", ALIGN_SHAPES)
def test_moe_align(rt, shape):
    T, E, A, bm = shape
    ids = RNG.integers(0, max(1, E // 2) if T > 100 else E, (T, A)).astype(np.int32)  # big T: half the experts idle
    sr, er, Pr = get_op("moe_align", "numpy")(ids, E, bm)
    s, e, P = run_moe_align(rt, ids, E, bm)
    assert P == Pr
    assert_close(s, sr, exact=True, what="sorted_ids")
    assert_close(e, er, exact=True, what="expert_ids")


@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_and_mul(rt, shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 4
    assert_close(run_silu_and_mul(rt, x), get_op("silu_and_mul", "numpy")(x), **F32_TOL)


@pytest.mark.parametrize("T,A,D", COMBINE_SHAPES)
def test_moe_combine(rt, T, A, D):
    y = RNG.standard_normal((T * A, D)).astype(np.float32)
    assert_close(run_moe_combine(rt, y, A), get_op("moe_combine", "numpy")(y, A), **F32_TOL)


@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_fp8_act_quant(rt, shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 10
    x[0, 0] = 1e-30  # underflows to a zero code
    if shape[0] > 1:
        x[1] = 0.0  # an all-zero row: scale 0, codes 0
    q, s = run_fp8_act_quant(rt, x)
    qr, sr = fp8_act_quant_ref(x)
    assert_close(q, qr, exact=True, what="e4m3 codes")
    assert_close(s, sr, exact=True, what="scales")


def test_fp8_encoder_every_code_and_tie(rt):
    """A row holding 448 has scale 1, so the kernel encodes the values themselves: every e4m3 value, the
    midpoints between neighbours (ties to even), values just off them, subnormals, and -0."""
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals)])  # sorted, +-448 included
    mids = (vals[:-1] + vals[1:]) / 2
    row = np.concatenate([vals, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), [-0.0, 1e-3, -3e-4]])
    x = np.resize(row.astype(np.float32), (1, -(-row.size // 32) * 32))
    q, s = run_fp8_act_quant(rt, x)
    qr, sr = fp8_act_quant_ref(x)
    assert s[0] == 1.0
    assert_close(q, qr, exact=True, what="e4m3 codes")


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(rt, shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 3
    w = RNG.standard_normal(shape[-1]).astype(np.float32)
    assert_close(run_rms_norm(rt, x, w, 1e-5), get_op("rms_norm", "numpy")(x, w, 1e-5), **F32_TOL)


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("fmt", GEMM_FORMATS)
@pytest.mark.parametrize("kind,block_m", GEMM_KINDS)
def test_moe_gemm(rt, shape, fmt, kind, block_m):
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = get_format(fmt).quantize(RNG.standard_normal((E, N, K)).astype(np.float32) * 0.1)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, block_m)
    ref = get_op("moe_gemm", "numpy")
    x = RNG.standard_normal((T, K)).astype(np.float32)  # GEMM1: tokens
    assert_close(run_moe_gemm(rt, x, w, sorted_ids, expert_ids, block_m, A, kind=kind),
                 ref(x, w, sorted_ids, expert_ids, block_m, A), **GEMM_TOL, what="GEMM1")
    xs = RNG.standard_normal((T * A, K)).astype(np.float32)  # GEMM2: slots, routing weight in the epilogue
    assert_close(run_moe_gemm(rt, xs, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=True, kind=kind),
                 ref(xs, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=True), **GEMM_TOL, what="GEMM2")


@pytest.mark.parametrize("shape", TC_SHAPES)
@pytest.mark.parametrize("fmt", TC_FORMATS)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_moe_gemm_tensor_core_path(shape, fmt, block_m, order):
    """The __CUDA_ARCH__ >= 800 path of moe_gemm_tiled (3xTF32 WMMA) on the emulated WMMA of cuda_src/emu."""
    rt = EmuRunner(reverse=order == "reverse", arch=800, select=lambda k: "moe_gemm_splitk" not in k)
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = get_format(fmt).quantize(RNG.standard_normal((E, N, K)).astype(np.float32) * 0.1)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, block_m)
    xs = RNG.standard_normal((T * A, K)).astype(np.float32)
    assert_close(run_moe_gemm(rt, xs, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=True, kind="tiled"),
                 get_op("moe_gemm", "numpy")(xs, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=True), **GEMM_TOL)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "q4_0"])
@pytest.mark.parametrize("T", [1, 20])
def test_fused_moe(rt, fmt, T):
    E, A, D, I = 8, 2, 128, 128
    ids, tw = routing(T, E, A)
    f = get_format(fmt)
    gate_up = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    down = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    assert_close(run_fused_moe(rt, x, tw, ids, gate_up, down), get_op("fused_moe", "numpy")(x, tw, ids, gate_up, down),
                 **FUSED_TOL.get(fmt, GEMM_TOL))


# ---- layout contracts: pure checks, named op and condition ---------------------------------------------
def test_contracts_name_op_and_condition():
    rt = EmuRunner()
    with pytest.raises(BackendError, match=r"topk_softmax.*logits.dtype is float64"):
        run_topk_softmax(rt, np.zeros((2, 8)), 2, True)
    with pytest.raises(BackendError, match=r"silu_and_mul.*C-contiguous"):
        run_silu_and_mul(rt, np.zeros((8, 4), np.float32).T)
    with pytest.raises(BackendError, match=r"rms_norm.*w.shape"):
        run_rms_norm(rt, np.zeros((2, 8), np.float32), np.zeros(7, np.float32), 1e-5)
    w = get_format("int4").quantize(np.zeros((2, 8, 64), np.float32))
    s, e, _ = get_op("moe_align", "numpy")(np.zeros((1, 1), np.int32), 2, 16)
    with pytest.raises(BackendError, match=r"moe_gemm.*x.shape\[1\]=32 != K=64"):
        run_moe_gemm(rt, np.zeros((1, 32), np.float32), w, s, e, 16, 1)
    with pytest.raises(BackendError, match=r"moe_gemm.*block_m=32"):
        run_moe_gemm(rt, np.zeros((1, 64), np.float32), w, s, e, 32, 1)
    with pytest.raises(BackendError, match=r"moe_gemm.*format 'f16' has no CUDA decoder"):
        run_moe_gemm(rt, np.zeros((1, 64), np.float32), get_format("f16").quantize(np.zeros((2, 8, 64))), s, e, 16, 1)
    assert set(DECODERS) <= set(__import__("toolkit.formats", fromlist=["FORMATS"]).FORMATS)


# ---- the emulator itself: barrier order and AddressSanitizer -------------------------------------------
# The ASan cases run in CI (about 15 s); alone: pytest tests/test_cuda_emulated.py -k asan
def test_reverse_order_exposes_missing_syncthreads():
    x = np.arange(1, 65, dtype=np.float32)
    want = np.concatenate([[0.0], x[:-1]]).astype(np.float32)
    kernels = ("shift_synced", "shift_unsynced")
    mod = emulate.module(CASES / "barrier_demo.cu", kernels)
    for reverse in (False, True):
        y = np.zeros_like(x)
        mod.launch("shift_synced", (1,), (64,), (x, y), reverse=reverse)
        assert_close(y, want, exact=True, what=f"synced, reverse={reverse}")
    for reverse in (False, True):  # fresh values each launch: emulated shared memory keeps the last block's
        x = x + 100.0
        want = np.concatenate([[0.0], x[:-1]]).astype(np.float32)
        y = np.zeros_like(x)
        mod.launch("shift_unsynced", (1,), (64,), (x, y), reverse=reverse)
        if reverse:
            assert not np.array_equal(y, want), "reverse order must expose the missing __syncthreads"
        else:
            assert np.array_equal(y, want), "forward order hides the race"


def test_divergent_barrier_is_reported_not_hung():
    mod = emulate.module(CASES / "barrier_demo.cu", ("divergent_sync",))
    with pytest.raises(RuntimeError, match="deadlock.*divergent"):
        mod.launch("divergent_sync", (1,), (64,), (np.zeros(64, np.float32),))
    with pytest.raises(RuntimeError, match="bad launch"):
        mod.launch("divergent_sync", (1,), (2048,), (np.zeros(64, np.float32),))


def _asan(case: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CASES / "asan_case.py"), case], env=emulate.asan_env(),
                          capture_output=True, text=True, timeout=300)


def test_asan_build_runs_ops_clean():
    r = _asan("ops")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_asan_build_catches_out_of_bounds_write():
    r = _asan("oob")
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, (r.returncode, r.stdout, r.stderr[-3000:])
