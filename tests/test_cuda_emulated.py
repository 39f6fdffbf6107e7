"""The CUDA kernels of cuda_src/, run on the CPU through cuda_src/emu (toolkit.gpu.emulate), against the NumPy
reference: the device-only stages and paths (moe_align's upper-bound layout, moe_combine, moe_gemm's split-K /
tiled / tensor-core kernels and every decoder, fp8 activations, kv_attention's forced key splits, sinks, shared
576-wide rows and queries without keys) and the contracts. The ops (the routers, rms_norm, silu_and_mul,
clamped_swiglu, moe_bias_add, fused_moe, kv_store, kv_attention, mla_q / mla_kv / mla_out, ...) are tested
once, on every backend, in tests/test_ops*.py. Every case runs with a block's threads in forward and in reverse
order (a missing __syncthreads shows in one of them); launchers (toolkit/gpu/<op>.py run_<op>) are exercised as
they are on a GPU, on the emulated device (``EmuDevice``), whose counters prove the launcher read nothing back
(helpers.run_on: a decode step never synchronises with the host) and whose fresh buffers hold garbage (NaN /
0x5A bytes: a kernel that leaves part of an output unwritten shows). Launch plans depend on shapes only
(test_launch_plans_depend_on_shapes_only).
Tolerances: exact for routing ids, align layouts and fp8 codes/scales; F32_TOL for reductions summed in a
different order; GEMM_TOL for K-long dot products (the kernels fuse multiply-adds).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_close, run_on
from toolkit.errors import BackendError
from toolkit.formats import FORMATS, get_format
from toolkit.formats.fp8 import fp8_act_quant_ref
from toolkit.gpu import emulate
from toolkit.gpu.fp8_act_quant import run_fp8_act_quant
from toolkit.gpu.device import EmuArray, EmuDevice
from toolkit.gpu.fused_moe import run_fused_moe
from toolkit.gpu.kv_attention import run_kv_attention
from toolkit.gpu.kv_store import check_positions, run_kv_store
from toolkit.gpu.moe_align import run_moe_align
from toolkit.gpu.moe_combine import run_moe_combine
from toolkit.gpu.moe_gemm import DECODERS, run_moe_gemm
from toolkit.gpu.rms_norm import run_rms_norm
from toolkit.gpu.silu_and_mul import run_silu_and_mul
from toolkit.gpu.topk_sigmoid import run_topk_sigmoid
from toolkit.gpu.topk_softmax import run_topk_softmax
from toolkit.gpu.topk_softmax_grouped import run_topk_softmax_grouped
from toolkit.ops import get_op

RNG = np.random.default_rng(0)
F32_TOL = dict(atol=2e-6, rtol=2e-5)
GEMM_TOL = dict(atol=2e-5, rtol=2e-5)
CASES = Path(__file__).with_name("cuda")

# (T, E, A, block_m): one token, experts without tokens, all slots to few experts, big blocks, many experts,
# no token at all, block_m 1 (no padding) and 7 (odd)
ALIGN_SHAPES = [(1, 8, 2, 16), (7, 4, 4, 16), (37, 8, 2, 16), (300, 8, 2, 64), (5, 60, 4, 16), (3, 16, 2, 64), (600, 4, 1, 16),
                (0, 8, 2, 16), (9, 5, 3, 1), (11, 6, 2, 7)]
# (T, A, D)
COMBINE_SHAPES = [(1, 2, 8), (5, 4, 300), (7, 1, 33)]
# [T, K]
ACT_SHAPES = [(1, 32), (5, 1000), (3, 4096)]
# (T, E, A, N, K): decode (1 token), top-k = E, experts with no token, prefill-ish (many slots per expert)
GEMM_SHAPES = [(1, 8, 2, 40, 128), (3, 4, 4, 64, 256), (5, 16, 2, 72, 128), (24, 4, 2, 48, 128)]
GEMM_FORMATS = ["int8", "fp8", "int4", "int3", "int2", "q8_0", "q4_0", "mxfp4", "int4-g32", "int3-g128"]
GEMM_KINDS = [("splitk", 16), ("tiled", 16), ("tiled", 64)]
# GGML's other block types (K a multiple of the k-quants' 256): decode and prefill-ish shapes, every decoder
GGML_FORMATS = [f.name for f in FORMATS.values() if f.kind == "ggml"]
GGML_SHAPES = [(1, 4, 2, 24, 256), (9, 4, 2, 40, 512)]
TC_SHAPES = [(3, 4, 4, 64, 256), (24, 4, 2, 48, 128)]  # the sm_80 tensor-core path: a few rows (slow to emulate)
TC_FORMATS = ["int8", "fp8", "int3", "q4_0"]
# (B, T, H, Hkv, hd, S, start), window, n_split (None: planned), max_keys (None: S): forced splits with empty
# ones (more splits than keys, a sliding window smaller than the split, a single split with one key), the
# window bounding the plan (100 keys: 2 splits), max_keys only a planning bound (too small, beyond S)
KV_SPLIT_CASES = [((1, 2, 4, 2, 64, 24, 10), 0, 1, None), ((1, 2, 4, 2, 64, 24, 10), 0, 3, None),
                  ((1, 2, 4, 2, 64, 24, 10), 0, 40, None), ((2, 3, 4, 2, 64, 300, 1), 0, 64, None),
                  ((1, 4, 4, 1, 64, 300, 200), 5, 16, None), ((2, 5, 4, 2, 32, 40, 30), 3, 7, None),
                  ((1, 1, 4, 2, 64, 300, 0), 0, 1, None), ((1, 1, 8, 2, 64, 300, 290), 100, None, None),
                  ((1, 1, 8, 2, 64, 300, 290), 0, None, 1), ((1, 1, 8, 2, 64, 300, 290), 0, None, 10_000)]
KV_ATT_TOL = dict(atol=2e-5, rtol=1e-4)  # f32 softmax, another summation order and expf


@pytest.fixture(params=["forward", "reverse"])
def rt(request):
    return EmuDevice(reverse=request.param == "reverse")


def routing(T, E, A):
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)  # [T, A]
    return ids, RNG.random((T, A)).astype(np.float32)


def test_grouped_router_contract(rt):
    with pytest.raises(BackendError, match=r"topk_sigmoid.*n_group=3 must divide E=8"):
        run_topk_sigmoid(rt, np.zeros((2, 8), np.float32), np.zeros(8, np.float32), 2, 3, 1, True, 1.0)
    with pytest.raises(BackendError, match=r"topk_softmax_grouped.*k=5 must be in 1..4"):
        run_topk_softmax_grouped(rt, np.zeros((2, 8), np.float32), 5, 4, 2, 1.0)


def align_blocks(T, A, E, bm):
    """M-blocks of the upper-bound layout: P_max = T*A + E*(block_m - 1) in whole blocks (at least one)."""
    return max(1, -(-(T * A + E * (bm - 1)) // bm))


@pytest.mark.parametrize("shape", ALIGN_SHAPES)
def test_moe_align(rt, shape):
    T, E, A, bm = shape
    ids = RNG.integers(0, max(1, E // 2) if T > 100 else E, (T, A)).astype(np.int32)  # big T: half the experts idle
    sr, er, Pr = get_op("moe_align", "numpy")(ids, E, bm)
    s, e, total = run_on(rt, run_moe_align, ids, E, bm)
    n_blocks = align_blocks(T, A, E, bm)
    assert_close(total, np.array([Pr], np.int32), exact=True, what="total (device)")
    assert s.shape == (n_blocks * bm,) and e.shape == (n_blocks,), (s.shape, e.shape)
    assert_close(s[:Pr], sr, exact=True, what="sorted_ids")
    assert_close(e[: Pr // bm], er, exact=True, what="expert_ids")
    assert_close(s[Pr:], np.full(s.size - Pr, T * A, np.int32), exact=True, what="sentinel slots past P")
    assert_close(e[Pr // bm :], np.full(n_blocks - Pr // bm, -1, np.int32), exact=True, what="-1 blocks past P")


@pytest.mark.parametrize("E,A,bm", [(8, 2, 16), (4, 4, 7), (16, 1, 64)])
def test_moe_align_worst_case_fills_the_bound(rt, E, A, bm):
    """One slot per expert: every expert's run is padded by block_m - 1, P == P_max, no block left over."""
    ids = np.arange(E, dtype=np.int32).reshape(E // A, A)[::-1].copy()  # [T, A], T*A = E
    s, e, total = run_on(rt, run_moe_align, ids, E, bm)
    sr, er, Pr = get_op("moe_align", "numpy")(ids, E, bm)
    assert Pr == E * bm == s.size and int(total[0]) == Pr
    assert_close(s, sr, exact=True, what="sorted_ids")
    assert_close(e, er, exact=True, what="expert_ids")


def upper_bound_layout(rt, ids, E, block_m, hostile: bool = False):
    """run_moe_align's layout ([P_cap], [P_cap / block_m]); ``hostile``: the slots of the -1 blocks get real
    slot ids instead of the sentinel, so a kernel that does not skip those blocks writes wrong rows."""
    s, e, total = run_on(rt, run_moe_align, ids, E, block_m)
    P = int(total[0])
    assert e[: P // block_m].min(initial=0) >= 0 and (e[P // block_m :] == -1).all()
    if hostile:
        s = s.copy()
        s[P:] = np.arange(s.size - P, dtype=np.int32) % max(1, ids.size)
    return s, e


def experts_after_a_hidden_one(fmt, E, N, K):
    """Weights ``[E, N, K]`` as views one expert into a buffer of E + 1: the memory an expert -1 would index holds
    real, nonzero weights, so a kernel that runs a -1 block reads them and writes wrong rows (not zeros)."""
    w = get_format(fmt).quantize(RNG.standard_normal((E + 1, N, K)).astype(np.float32) * 0.1)
    return dataclasses.replace(w, shape=(E, N, K), arrays={k: a[1:] for k, a in w.arrays.items()})


@pytest.mark.parametrize("T,A,D", COMBINE_SHAPES)
def test_moe_combine(rt, T, A, D):
    y = RNG.standard_normal((T * A, D)).astype(np.float32)
    assert_close(run_on(rt, run_moe_combine, y, A), get_op("moe_combine", "numpy")(y, A), **F32_TOL)


@pytest.mark.parametrize("shape", ACT_SHAPES)
def test_fp8_act_quant(rt, shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 10
    x[0, 0] = 1e-30  # underflows to a zero code
    if shape[0] > 1:
        x[1] = 0.0  # an all-zero row: scale 0, codes 0
    q, s = run_on(rt, run_fp8_act_quant, x)
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
    q, s = run_on(rt, run_fp8_act_quant, x)
    qr, sr = fp8_act_quant_ref(x)
    assert s[0] == 1.0
    assert_close(q, qr, exact=True, what="e4m3 codes")


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("fmt", GEMM_FORMATS)
@pytest.mark.parametrize("kind,block_m", GEMM_KINDS)
def test_moe_gemm(rt, shape, fmt, kind, block_m):
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one(fmt, E, N, K)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, block_m)  # the reference's exact layout
    ub_s, ub_e = upper_bound_layout(rt, ids, E, block_m)  # the kernels run on moe_align's upper-bound layout
    ref = get_op("moe_gemm", "numpy")
    x = RNG.standard_normal((T, K)).astype(np.float32)  # GEMM1: tokens
    assert_close(run_on(rt, run_moe_gemm, x, w, ub_s, ub_e, block_m, A, kind=kind),
                 ref(x, w, sorted_ids, expert_ids, block_m, A), **GEMM_TOL, what="GEMM1")
    ub_s, ub_e = upper_bound_layout(rt, ids, E, block_m, hostile=True)
    xs = RNG.standard_normal((T * A, K)).astype(np.float32)  # GEMM2: slots, routing weight in the epilogue
    assert_close(run_on(rt, run_moe_gemm, xs, w, ub_s, ub_e, block_m, A, tw, x_is_slots=True, kind=kind),
                 ref(xs, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=True), **GEMM_TOL, what="GEMM2")


@pytest.mark.parametrize("shape", GGML_SHAPES)
@pytest.mark.parametrize("fmt", GGML_FORMATS)
@pytest.mark.parametrize("kind", ["splitk", "tiled"])
def test_moe_gemm_ggml_block_types(rt, shape, fmt, kind):
    """q4_1 / q5_0 / q5_1 / q2_K..q6_K decoders (cuda_src/formats.cuh) read the stored blocks as the reference does."""
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one(fmt, E, N, K)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 16)
    ub_s, ub_e = upper_bound_layout(rt, ids, E, 16, hostile=True)
    xs = RNG.standard_normal((T * A, K)).astype(np.float32)
    assert_close(run_on(rt, run_moe_gemm, xs, w, ub_s, ub_e, 16, A, tw, x_is_slots=True, kind=kind),
                 get_op("moe_gemm", "numpy")(xs, w, sorted_ids, expert_ids, 16, A, tw, x_is_slots=True), **GEMM_TOL)


@pytest.mark.parametrize("shape", TC_SHAPES)
@pytest.mark.parametrize("fmt", TC_FORMATS)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_moe_gemm_tensor_core_path(shape, fmt, block_m, order):
    """The __CUDA_ARCH__ >= 800 path of moe_gemm_tiled (3xTF32 WMMA) on the emulated WMMA of cuda_src/emu."""
    rt = EmuDevice(reverse=order == "reverse", arch=800, select=lambda k: "moe_gemm_splitk" not in k)
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = experts_after_a_hidden_one(fmt, E, N, K)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, block_m)
    ub_s, ub_e = upper_bound_layout(EmuDevice(), ids, E, block_m, hostile=True)
    xs = RNG.standard_normal((T * A, K)).astype(np.float32)
    assert_close(run_on(rt, run_moe_gemm, xs, w, ub_s, ub_e, block_m, A, tw, x_is_slots=True, kind="tiled"),
                 get_op("moe_gemm", "numpy")(xs, w, sorted_ids, expert_ids, block_m, A, tw, x_is_slots=True), **GEMM_TOL)


def kv_rows(fmt, B, T, Hkv, hd, scale=1.0):
    x = (RNG.standard_normal((B, T, Hkv, hd)) * scale).astype(np.float32)  # [B, T, Hkv, hd]
    blk = x.reshape(-1, 32)  # [n_blocks, 32] view
    if blk.shape[0] >= 4:  # blocks that stress the codecs:
        blk[0] = 0.0  # all zero: d = 0, inverse 0
        blk[1] = RNG.uniform(-1, 1, 32)
        blk[1, [3, 9]] = [-2.0, 2.0]  # a tie of |max|: q4_0 takes the first (signed) one
        blk[2] = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26  # q8_0: d = 1, exact halves round away from 0
        blk[3] = [-8.0, 0.5, -0.5, 7.5, -7.5, 3.0] + [0.25] * 26  # q4_0: d = 1, x + 8.5 on integers and halves
    return x


def kv_case(kf, vf, B, T, H, Hkv, hd, S, start):
    k_fmt, v_fmt = get_format(kf), get_format(vf)
    positions = (start + np.arange(T, dtype=np.int32))[None].repeat(B, 0)  # [B, T]
    positions[-1] -= min(start, 1 if B > 1 else 0)  # sequences at different depths
    stores = []
    for f in (k_fmt, v_fmt):
        (spec,) = f.arrays((1, hd)).values()
        st = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)
        get_op("kv_store", "numpy")(st, f, kv_rows(f, B, S, Hkv, hd), np.arange(S, dtype=np.int32)[None].repeat(B, 0))
        stores.append(st)
    q = RNG.standard_normal((B, T, H, hd)).astype(np.float32)
    return q, stores[0], stores[1], k_fmt, v_fmt, positions, np.float32(1 / np.sqrt(hd))


@pytest.mark.parametrize("case", KV_SPLIT_CASES)
@pytest.mark.parametrize("kf,vf", [("f32", "f32"), ("q8_0", "q4_0")])
def test_kv_attention_key_split(rt, case, kf, vf):
    """The split over keys (incl. splits with no key: n_split > visible keys, a window smaller than a split)
    equals the unsplit reference, with no NaN; max_keys only bounds the plan."""
    shape, window, n_split, max_keys = case
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case(kf, vf, *shape)
    want = get_op("kv_attention", "numpy")(q, ks, vs, k_fmt, v_fmt, positions, scale, window)
    got = run_on(rt, run_kv_attention, q, ks, vs, k_fmt, v_fmt, positions, scale, window, n_split=n_split, max_keys=max_keys)
    assert np.isfinite(got).all()
    assert_close(got, want, **KV_ATT_TOL, what=f"n_split={n_split}, window={window}, max_keys={max_keys}")


@pytest.mark.parametrize("n_split", [1, 3])
@pytest.mark.parametrize("kf,vf", [("f32", "f32"), ("q8_0", "q4_0")])
def test_kv_attention_sinks(rt, kf, vf, n_split):
    """gpt-oss's attention sinks: one more logit per head in the denominator, split over keys or not."""
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case(kf, vf, 2, 3, 4, 2, 64, 40, 0)
    sinks = (RNG.standard_normal(4) * 3).astype(np.float32)
    want = get_op("kv_attention", "numpy")(q, ks, vs, k_fmt, v_fmt, positions, scale, 5, sinks)
    got = run_on(rt, run_kv_attention, q, ks, vs, k_fmt, v_fmt, positions, scale, 5, n_split=n_split, sinks=sinks)
    assert_close(got, want, **KV_ATT_TOL, what=f"sinks, n_split={n_split}")


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_split", [1, 3])
def test_kv_attention_wide_rows_shared_by_k_and_v(rt, fmt, n_split):
    """MLA's cache: one KV head of 576-wide rows (latent 512 + rope 64), one store read as keys and values."""
    q, ks, _, k_fmt, _, positions, scale = kv_case(fmt, fmt, 1, 2, 4, 1, 576, 30, 20)
    want = get_op("kv_attention", "numpy")(q, ks, ks, k_fmt, k_fmt, positions, scale, 0)
    got = run_on(rt, run_kv_attention, q, ks, ks, k_fmt, k_fmt, positions, scale, 0, n_split=n_split)
    assert_close(got, want, **KV_ATT_TOL, what=f"{fmt} rows of 576")
    with pytest.raises(BackendError, match="one cache format for K and V"):
        run_kv_attention(rt, q, ks, ks, k_fmt, get_format("f32" if fmt != "f32" else "q8_0"), positions, scale, 0)


@pytest.mark.parametrize("n_split", [1, 4])
def test_kv_attention_query_without_keys_gives_zero(rt, n_split):
    """A position the runtime would reject (< 0: no visible key; >= S: keys clamped to the store) reads no row
    outside the store and yields finite values: 0 where no key is visible, never 0 / 0."""
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case("q8_0", "f32", 1, 3, 4, 2, 64, 24, 0)
    positions[0] = [-1, -5, 24 + 7]
    got = run_on(rt, run_kv_attention, q, ks, vs, k_fmt, v_fmt, positions, scale, 0, n_split=n_split)
    assert_close(got[:, :2], np.zeros_like(got[:, :2]), exact=True, what="no visible key")
    want = get_op("kv_attention", "numpy")(q[:, 2:], ks, vs, k_fmt, v_fmt, np.full((1, 1), 23, np.int32), scale, 0)
    assert_close(got[:, 2:], want, **KV_ATT_TOL, what="keys clamped to S")


def recorded_plan(fn, *args, **kw) -> list:
    """The launches ``fn(rt, *args)`` makes: kernel, grid, block, each array argument's shape and dtype, each
    scalar argument's value."""
    plan = []

    class Recorder(EmuDevice):
        def launch(self, stem, kernel, grid, block, args, shared_mem=0):
            plan.append((stem, kernel, tuple(grid), tuple(block), tuple(
                (a.shape, a.dtype.str) if isinstance(a, (np.ndarray, EmuArray)) else a.item() for a in args), shared_mem))
            super().launch(stem, kernel, grid, block, args, shared_mem)

    run_on(Recorder(), fn, *args, **kw)
    return plan


def test_launch_plans_depend_on_shapes_only():
    """Same shapes, other data (routing, positions): the same launches with the same arguments, so a decode
    step can be recorded once and replayed (or captured as a CUDA graph)."""
    E, A, D, I, T = 8, 2, 64, 64, 3
    f = get_format("int4")
    gate_up = f.quantize(RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1)
    down = f.quantize(RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    plans = []
    for ids in (np.array([[0, 1]] * T, np.int32), np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)):
        tw = RNG.random((T, A)).astype(np.float32)
        plans.append(recorded_plan(run_fused_moe, x, tw, ids, gate_up, down))
    assert plans[0] == plans[1] and len(plans[0]) == 7, plans
    plans = []
    for start in (0, 250):
        q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case("q8_0", "q8_0", 1, 1, 4, 2, 64, 300, start)
        plans.append(recorded_plan(run_kv_attention, q, ks, vs, k_fmt, v_fmt, positions, scale))
        plans.append(recorded_plan(run_kv_store, ks, k_fmt, kv_rows(k_fmt, 1, 1, 2, 64), positions))
    assert plans[0] == plans[2] and plans[1] == plans[3], plans
    assert plans[0][0][2][1] == 5 and plans[0][-1][1] == "kv_attention_combine"  # 5 splits planned from S=300


def test_device_backends_resolve_to_device_ops():
    """get_op(name, 'cuda-emu') is the device-resident op of toolkit/gpu/ops.py bound to the emulated device;
    'cuda' without a GPU is refused with the reason and the way out."""
    from toolkit.gpu.ops import DeviceOps

    for name in ("kv_store", "kv_attention", "fused_moe", "sample"):
        fn = get_op(name, "cuda-emu")
        assert isinstance(fn.__self__, DeviceOps) and fn.__self__.dev.name == "cuda-emu"
    from toolkit.backend import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        with pytest.raises(BackendError, match="cuda-emu"):
            get_op("kv_store", "cuda")


# ---- layout contracts: pure checks, named op and condition ---------------------------------------------
def test_contracts_name_op_and_condition():
    rt = EmuDevice()
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
    q8 = get_format("q8_0")
    st = np.zeros((1, 2, 4, 68), np.uint8)
    x = np.zeros((1, 1, 2, 64), np.float32)
    with pytest.raises(BackendError, match=r"kv_store.*positions.dtype is int64"):
        run_kv_store(rt, st, q8, x, np.zeros((1, 1), np.int64))
    with pytest.raises(BackendError, match=r"kv_store.*positions must lie in \[0, S=4\)"):
        check_positions("kv_store", np.full((1, 1), 4, np.int32), 4)  # the host check (runtime, get_op entries)
    for bad in (4, -1):  # the launcher does not read positions; the kernel skips a row outside [0, S)
        run_on(EmuDevice(), run_kv_store, st, q8, np.ones_like(x), np.array([[bad]], np.int32))
    assert not st.any()
    with pytest.raises(BackendError, match=r"kv_store.*store.shape is \(1, 2, 4, 68\), expected \(1, 2, S, 36\)"):
        run_kv_store(rt, st, get_format("q4_0"), x, np.zeros((1, 1), np.int32))
    with pytest.raises(BackendError, match=r"kv_store.*format 'int4.*' has no CUDA row codec"):
        run_kv_store(rt, st, get_format("int4"), x, np.zeros((1, 1), np.int32))
    with pytest.raises(BackendError, match=r"kv_attention.*H=3 query heads must be a multiple of Hkv=2"):
        run_kv_attention(rt, np.zeros((1, 1, 3, 64), np.float32), st, st, q8, q8, np.zeros((1, 1), np.int32), 1.0)
    with pytest.raises(BackendError, match=r"kv_attention.*head dim 608 must be a multiple of 32 in \[32, 576\]"):
        run_kv_attention(rt, np.zeros((1, 1, 2, 608), np.float32), st, st, q8, q8, np.zeros((1, 1), np.int32), 1.0)
    with pytest.raises(BackendError, match=r"kv_attention.*head dim 256 > 128 needs one cache format for K and V"):
        run_kv_attention(rt, np.zeros((1, 1, 2, 256), np.float32), st, st, q8, get_format("q4_0"), np.zeros((1, 1), np.int32), 1.0)


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


# ---- the GPU benchmark's plumbing (python -m toolkit.bench cuda --dry-run) ------------------------------
def test_bench_cuda_dry_run(capsys):
    from toolkit.bench import cuda as bench_cuda

    rows = bench_cuda.run(["--dry-run", "--formats", "int8,fp8,int4-g128", "--tokens", "1,4", "--layer-tokens", "1",
                           "--model-decode", ""])
    out = capsys.readouterr().out
    assert {(r["format"], r["M"]) for r in rows if "dense fp16 us" in r} == {
        (f, m) for f in ("int8", "fp8", "int4-g128") for m in (1, 4)}
    assert "GEMM1" in out and "fused MoE layer" in out
    assert all(r["us"] > 0 and r["GB/s touched"] > 0 for r in rows)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_1", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
def test_bench_random_blocks_have_sane_scales(fmt):
    """The GPU bench's random GGML blocks: every f16 field (d, and dmin or m) set to 2^-8, so no weight is NaN and
    the k-quants that repack do (random bytes there could be a NaN, or a d too big to repack: the bench would then
    time the stored layout under the packed one's name)."""
    from toolkit.bench.cuda import random_qtensor
    from toolkit.gpu import mma_pack

    qt = random_qtensor(np, get_format(fmt), (2, 128, 512))
    assert np.isfinite(qt.dequantize("numpy")).all()
    assert mma_pack.packable(qt) == (mma_pack.decoder(qt.fmt) is not None)


def test_bench_cuda_without_gpu_exits_with_a_message():
    from toolkit.backend import cuda_unavailable_reason

    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "toolkit.bench", "cuda"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr
