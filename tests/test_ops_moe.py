"""The MoE ops on every backend against their NumPy references, over module-level shape tables (tolerances
declared per op): the routers, the pipeline's stages (moe_align -> moe_gemm -> activation -> moe_gemm ->
moe_combine), the dense f32 experts, fused_moe and qlinear in every registry format, gpt-oss's biased experts,
and igemm (the grouped GEMM on int8 activations); the harness: tests/ops_harness.py. Numba's own paths (forced
decode / prefill GEMM kernels, int8 activations, the igemm register tile against the one-row kernel) have their
tests in tests/test_moe_pipeline.py and tests/test_igemm.py.

Tolerances: routing ids and align layouts exact; f32 products within ``MOE_TOL`` of the output's scale (both sides
decode the same codes to the same f32 values, only the summation order differs); W8A8 against the reference
W8A8 path; igemm exact with power-of-two scales and within the spec's ``error_bound`` otherwise."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from helpers import assert_close
from ops_harness import F32_TOL, RNG, backend, both, normal, rounds_operands  # noqa: F401 - backend, both: fixtures
from toolkit.backend import DEVICE_BACKENDS
from toolkit.formats import FORMATS, QTensor, get_format
from toolkit.ops import get_op

# (T, E, A): one token, top-k = E, top-1, Mixtral's 8/2
ROUTER_SHAPES = [(1, 8, 2), (7, 4, 4), (16, 8, 1), (64, 8, 2), (5, 60, 4), (3, 256, 8)]  # + DeepSeek-size 256/8
# (T, E, A, D, I): one token, top-k = E, experts with no token, all to one expert (T=1, A=1); a few rows per
# expert (numba: the grouped GEMV, odd and even rows per expert), rows not a multiple of 4 (its remainder rows),
# many rows per expert (numba: BLAS)
MOE_SHAPES = [(1, 8, 2, 32, 48), (6, 4, 4, 16, 24), (3, 16, 2, 32, 32), (1, 4, 1, 64, 32), (40, 8, 2, 64, 96),
              (5, 4, 2, 7, 13), (64, 4, 2, 32, 48)]


@pytest.mark.parametrize("shape", ROUTER_SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax(both, shape, renormalize):
    ref, fast = both("topk_softmax")
    T, E, A = shape
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    wr, ir = ref(logits, A, renormalize)
    wf, idf = fast(logits, A, renormalize)
    assert_close(idf, ir, exact=True, what="expert ids")
    assert_close(wf, wr, **F32_TOL, what="routing weights")


def test_topk_softmax_ties_pick_lower_id(both):
    _, fast = both("topk_softmax")
    w, ids = fast(np.array([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0] * 5], np.float32), 2, True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert_close(w, np.full((2, 2), 0.5, np.float32), atol=1e-7)


# grouped routers: (T, E, A, n_group, topk_group); n_group 1 is plain top-k, topk_group = n_group keeps all groups
GROUPED_ROUTER_SHAPES = [(1, 8, 2, 1, 1), (7, 8, 2, 4, 2), (16, 16, 3, 4, 1), (5, 64, 6, 8, 3), (3, 256, 8, 8, 4),
                         (4, 6, 6, 2, 2), (9, 60, 4, 1, 1)]


@pytest.mark.parametrize("shape", GROUPED_ROUTER_SHAPES)
@pytest.mark.parametrize("name", ["topk_sigmoid", "topk_softmax_grouped"])
def test_grouped_routers(both, name, shape):
    """DeepSeek-V3's sigmoid router with a selection bias and V2's softmax one, both group-limited."""
    ref, fast = both(name)
    T, E, A, G, TG = shape
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    args = (A, G, TG, True, 2.5) if name == "topk_sigmoid" else (A, G, TG, 1.5)
    bias = (RNG.standard_normal(E) * 0.2).astype(np.float32)
    (wr, ir), (wf, idf) = [f(logits, bias, *args) if name == "topk_sigmoid" else f(logits, *args) for f in (ref, fast)]
    assert_close(idf, ir, exact=True, what="expert ids")
    assert_close(wf, wr, **F32_TOL, what="routing weights")
    n = E // G  # every chosen expert lies in one of the topk_group best groups
    assert len({int(i) // n for i in ir[0]}) <= TG


@pytest.mark.parametrize("where", ["numpy", "numba"])
def test_grouped_router_rules(where):
    """The group rule by hand: V3 ranks groups by the sum of their two best (biased) scores, V2 by their best;
    the bias steers the choice but the weights are the unbiased sigmoids; ties go to the lower id."""
    sig = get_op("topk_sigmoid", where)
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    x = logit(np.array([[0.9, 0.1, 0.6, 0.6, 0.2, 0.2]], np.float32)).astype(np.float32)  # groups of 2
    w, ids = sig(x, None, 2, 3, 1, False, 1.0)  # group sums 1.0, 1.2, 0.4: the middle group wins
    assert ids.tolist() == [[2, 3]]
    assert_close(w, np.array([[0.6, 0.6]], np.float32), atol=1e-6)
    bias = np.array([0, 0, 0, 0, 0.5, 0.5], np.float32)  # now group 2 leads (1.4) and its experts are chosen
    w, ids = sig(x, bias, 2, 3, 1, True, 2.0)
    assert ids.tolist() == [[4, 5]]
    assert_close(w, np.array([[1.0, 1.0]], np.float32), atol=1e-6)  # renormalised sigmoids 0.5 each, times 2
    soft = get_op("topk_softmax_grouped", where)
    p = np.array([[0.30, 0.01, 0.20, 0.20, 0.15, 0.14]], np.float32)  # group max 0.30, 0.20, 0.15
    w, ids = soft(np.log(p), 3, 3, 2, 1.0)
    assert ids.tolist() == [[0, 2, 3]]
    assert_close(w, p[:, [0, 2, 3]], atol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_moe_bias_add(both, weighted):
    ref, fast = both("moe_bias_add")
    T, A, E, N = 5, 3, 7, 33
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32) if weighted else None
    y, b = RNG.standard_normal((T * A, N)).astype(np.float32), RNG.standard_normal((E, N)).astype(np.float32)
    want = ref(y.copy(), b, ids, w)
    assert_close(want[4], y[4] + (w[1, 1] if weighted else 1) * b[ids[1, 1]], atol=1e-6)  # row t*A + a
    assert_close(fast(y.copy(), b, ids, w), want, **F32_TOL)


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_moe_experts(both, backend, shape):
    ref, fast = both("moe_experts")
    T, E, A, D, I = shape
    x = RNG.standard_normal((T, D)).astype(np.float32)
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32)
    gate_up = RNG.standard_normal((E, 2 * I, D)).astype(np.float32) * 0.1
    down = RNG.standard_normal((E, D, I)).astype(np.float32) * 0.1
    if backend in DEVICE_BACKENDS and (D % 32 or I % 32):  # the device GEMM reads K in blocks of 32: its contract
        from toolkit.errors import BackendError

        with pytest.raises(BackendError, match=r"moe_gemm: layout contract broken: K=\d+ must be a multiple of 32"):
            fast(x, ids, w, gate_up, down)
        return
    assert_close(fast(x, ids, w, gate_up, down), ref(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


# ---- the quantized experts: fused_moe (align -> GEMM1 -> activation -> GEMM2 -> combine) and qlinear ----
# every registry format, group-wise ones at every group size (GGML's q4_1 / q5_* and k-quants, K a multiple of
# 256, have their own tables in tests/test_kquant.py and test_cuda_emulated.py)
QUANT_SPECS = [f"{f.name}-g{g}" for f in FORMATS.values() for g in f.group_sizes] + \
              [f.name for f in FORMATS.values() if not f.group_sizes and f.kind != "ggml"]
# the formats cuda-emu runs the whole pipeline in (the emulator's cost); each CUDA decoder has its moe_gemm rows
# in tests/test_cuda_emulated.py; a GPU runs every format
EMU_SPECS = {"int4", "fp8", "q4_0"}
# (T, E, A, D, I, one_expert): one token, top-k = E, experts with no token, all tokens on expert 0, prefill-sized;
# T=20 over 8 experts (the device's block_m 16 with a few blocks per expert), 48 x 2 slots over 2 experts (the
# device's block_m 64: block_m_for)
FUSED_SHAPES = [(1, 8, 2, 128, 128, False), (6, 4, 4, 128, 256, False), (3, 16, 2, 256, 128, False),
                (12, 4, 1, 128, 128, True), (24, 4, 2, 128, 256, False), (20, 8, 2, 128, 128, False),
                (48, 2, 2, 128, 128, False)]
# gpt-oss's experts (per-expert biases on both GEMMs, the clamped SwiGLU): (T, E, A, D, I, format); f32 runs
# moe_experts, the quantized ones fused_moe
BIAS_CASES = [(T, 6, 2, 64, 96, spec) for spec in ("mxfp4", "int4-g32", "f32") for T in (1, 5, 40)] + \
             [(T, 8, 2, 128, 64, "mxfp4") for T in (1, 20)]
MOE_TOL = 2e-5  # |err| <= MOE_TOL * max|reference| + 1e-6: f32 sums over K in another order
TC_TOL = 4e-3  # the same on tensor cores with f16 operands (ops_harness.rounds_operands): measured <= 5e-4 on an H200
FLIP = 0.02  # of max|reference|: one W8A8 activation code flipped through the down GEMM (measured <= 0.007)


def close_moe(actual, expected, w8a8=False, what="", tc=False):
    """Weight-only: every value within ``MOE_TOL`` of the output's scale (both sides decode the same codes to the
    same f32 values, only the summation order differs). W8A8 quantizes the intermediate (after GEMM1 and the
    activation) before GEMM2: an f32 sum in another order can put one value on the other side of an fp8 rounding
    boundary, and that token's row moves by one code step through the down GEMM (seen in ~6 of 100 random cases,
    always one row): every row within ``MOE_TOL``, but at most one row in eight within ``FLIP``. A wrong expert,
    scale or token is O(1). ``tc``: weight-only products on tensor cores (f16 operands), within ``TC_TOL``."""
    scale = float(np.abs(expected).max())
    if not w8a8:
        return assert_close(actual, expected, atol=(TC_TOL if tc else MOE_TOL) * scale + 1e-6, what=what)
    err = np.abs(actual - expected).max(axis=1)  # [T] worst element per token row
    off = np.nonzero(err > MOE_TOL * scale + 1e-6)[0]
    assert len(off) <= max(1, len(err) // 8) and (err[off] <= FLIP * scale).all(), \
        f"{what}: rows {off.tolist()} off by {(err[off] / scale).round(4).tolist()} of max|ref|"


def moe_routing(T, E, A, one_expert=False):
    """ids [T, A] (distinct per token; ``one_expert``: slot a -> expert a, so A=1 puts all on expert 0) and
    weights [T, A] summing to 1."""
    if one_expert:
        ids = np.zeros((T, A), np.int32) + np.arange(A, dtype=np.int32)
    else:
        ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def quant_case(backend, spec):
    """Skips a format cuda-emu does not run (cost); on a device, a format without a CUDA decoder is refused by
    name (moe_gemm's contract): returns False then, after checking the refusal is what ``call`` raises."""
    if backend == "cuda-emu" and get_format(spec).name not in EMU_SPECS:
        pytest.skip(f"{spec}: cuda-emu runs the experts in {sorted(EMU_SPECS)} (emulation cost)")
    return backend not in DEVICE_BACKENDS or get_format(spec).cuda_decoder is not None


def refused(call, spec):
    from toolkit.errors import BackendError

    with pytest.raises(BackendError, match=rf"moe_gemm.*format '{get_format(spec).name}' has no CUDA decoder"):
        call()


def quantized(spec, shape, scale=0.1):
    return get_format(spec).quantize(normal(*shape, scale=scale), "numba")


# ---- the pipeline's stages: moe_align -> moe_gemm (GEMM1, GEMM2 with the routing weights) -> moe_combine --------
# (T, E, A, block_m, one_expert): one token, top-k = E, experts with no token, all tokens on expert 0, many rows,
# block_m 1, odd block_m (3, and 7 over all-on-one-expert rows), blocks larger than every run (64)
ALIGN_SHAPES = [(1, 8, 2, 4, False), (6, 4, 4, 16, False), (3, 16, 2, 4, False), (9, 4, 1, 8, True),
                (40, 8, 2, 16, False), (128, 8, 2, 64, False), (1, 4, 4, 1, False), (7, 5, 2, 1, False),
                (11, 6, 3, 3, False), (5, 3, 2, 7, True)]
# (T, E, A, N, K, block_m), K a multiple of the largest group (128): one token, top-k = E, sparse experts, odd N,
# 2-3 rows per expert (fused affine decode-and-dot over several rows), prefill-sized (> 8 rows per expert),
# block_m 1 and odd
GEMM_SHAPES = [(1, 8, 2, 33, 128, 4), (5, 4, 4, 24, 256, 4), (3, 16, 2, 7, 128, 4), (7, 3, 1, 9, 256, 4),
               (40, 4, 2, 48, 128, 4), (6, 4, 2, 16, 128, 1), (9, 5, 3, 17, 128, 3)]
# (T, A, D): one token on one slot, top-k = E = 8, odd D, a Mixtral row (D 4096)
COMBINE_SHAPES = [(1, 1, 1), (4, 3, 40), (5, 8, 33), (3, 2, 4096)]


@pytest.mark.parametrize("shape", ALIGN_SHAPES)
def test_moe_align(both, shape):
    """The layout exactly as the reference's, and the reference's own contract."""
    ref, fast = both("moe_align")
    T, E, A, bm, one = shape
    ids, _ = moe_routing(T, E, A, one)
    want = ref(ids, E, bm)
    got = fast(ids, E, bm)
    assert_close(got[0], want[0], exact=True, what="sorted_ids")
    assert_close(got[1], want[1], exact=True, what="expert_ids")
    assert got[2] == want[2] == want[0].size and want[2] % bm == 0
    flat = ids.reshape(-1)
    real = want[0][want[0] < flat.size]
    assert sorted(real.tolist()) == list(range(flat.size))  # every slot exactly once
    assert (flat[want[0].reshape(-1, bm)[:, 0]] == want[1]).all()  # a block's first slot is real, of its expert
    assert set(want[1].tolist()) == set(flat.tolist())  # experts without tokens get no block


def moe_gemm_cases(spec, shape):
    """moe_gemm's two calls of the pipeline on one weight and layout: (what, args) of GEMM1 (x [T, K], slot s
    reads token s // A) and GEMM2 (one input row per slot, times its routing weight)."""
    T, E, A, N, K, bm = shape
    ids, tw = moe_routing(T, E, A)
    w = quantized(spec, (E, N, K))
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, bm)
    return [("GEMM1", (normal(T, K), w, sorted_ids, expert_ids, bm, A)),
            ("GEMM2", (normal(T * A, K), w, sorted_ids, expert_ids, bm, A, tw, True))]


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("spec", QUANT_SPECS)
def test_moe_gemm(both, spec, shape):
    ref, fast = both("moe_gemm")
    for what, args in moe_gemm_cases(spec, shape):
        close_moe(fast(*args), ref(*args), what=f"{what} {spec}")


@pytest.mark.parametrize("shape", COMBINE_SHAPES)
def test_moe_combine(both, shape):
    ref, fast = both("moe_combine")
    T, A, D = shape
    y = normal(T * A, D)  # [T*A, D]
    close_moe(fast(y, A), ref(y, A), what="moe_combine")


@pytest.mark.parametrize("shape", FUSED_SHAPES)
@pytest.mark.parametrize("spec", QUANT_SPECS)
def test_fused_moe(both, backend, spec, shape):
    ref, fast = both("fused_moe")
    runs = quant_case(backend, spec)
    T, E, A, D, I, one = shape
    ids, tw = moe_routing(T, E, A, one)
    f = get_format(spec)
    gate_up, down = quantized(spec, (E, 2 * I, D)), quantized(spec, (E, D, I))
    x = normal(T, D)
    if not runs:
        return refused(lambda: fast(x, tw, ids, gate_up, down), spec)
    got = fast(x, tw, ids, gate_up, down)
    w8a8 = f.act_quant is not None
    if not w8a8:  # weight-only: the dense expert MoE on the dequantized weights (the reference pipeline too)
        want = get_op("moe_experts", "numpy")(x, ids, tw, gate_up.dequantize(), down.dequantize())
        close_moe(ref(x, tw, ids, gate_up, down), want, what=f"fused_moe reference {spec}")
    else:  # W8A8: the reference pipeline (activations quantized before each GEMM)
        want = ref(x, tw, ids, gate_up, down)
    close_moe(got, want, w8a8, what=f"fused_moe {spec}", tc=rounds_operands(backend))


# Mixtral's expert shape, 2 tokens on 2 of its experts (the NumPy oracle on a full E=8 layer is too big):
# (T, E, A, D, I, format)
FUSED_REAL = [(2, 2, 1, 4096, 14336, "int4-g128")]


@functools.lru_cache(maxsize=1)
def real_moe_case(T, E, A, D, I, spec):
    """Inputs and the dense reference's output, built once for every backend: the experts quantized one by one
    (never all of them in f32 at once) and only the routed ones decoded for the reference."""
    fmt = get_format(spec)
    ids, tw = moe_routing(T, E, A)

    def experts(n, k):  # -> QTensor [E, n, k], dense f32 [E, n, k] (zeros for experts without a token)
        qs = [quantized(spec, (n, k), scale=0.02) for _ in range(E)]
        stacked = QTensor(fmt, (E, n, k), {a: np.stack([q.arrays[a] for q in qs]) for a in qs[0].arrays})
        dense = np.zeros((E, n, k), np.float32)
        for e in np.unique(ids):
            dense[e] = qs[e].dequantize("numba")
        return stacked, dense

    (gate_up, gu), (down, dn) = experts(2 * I, D), experts(D, I)
    x = normal(T, D)
    return x, tw, ids, gate_up, down, get_op("moe_experts", "numpy")(x, ids, tw, gu, dn)


@pytest.mark.parametrize("case", FUSED_REAL)
def test_fused_moe_real_model(both, backend, case):
    _, fast = both("fused_moe")
    if backend == "cuda-emu" and os.environ.get("MOQE_EMU_REVERSE"):
        pytest.skip("the reverse thread order runs the small rows (Mixtral's shape: 13 s more per emulated run)")
    quant_case(backend, case[-1])
    x, tw, ids, gate_up, down, want = real_moe_case(*case)
    close_moe(fast(x, tw, ids, gate_up, down), want, what=f"Mixtral-shape fused_moe {case[-1]}",
              tc=rounds_operands(backend))


@pytest.mark.parametrize("case", BIAS_CASES)
def test_experts_with_biases_and_clamped_swiglu(both, backend, case):
    """gpt-oss's expert part, in the grouped pipeline (quantized) and moe_experts (f32), against the dense
    reference on the same weights, token by token."""
    T, E, A, D, I, spec = case
    _, fast = both("moe_experts" if spec == "f32" else "fused_moe")
    ids, tw = moe_routing(T, E, A)
    gu, dn = normal(E, 2 * I, D, scale=0.3), normal(E, D, I, scale=0.3)
    bias = (normal(E, 2 * I), normal(E, D))
    x = normal(T, D, scale=3)
    act = ("clamped_swiglu", 1.702, 7.0)
    if spec == "f32":
        got = fast(x, ids, tw, gu, dn, bias, act)
    else:
        quant_case(backend, spec)
        gate_up, down = (get_format(spec).quantize(w, "numba") for w in (gu, dn))
        got = fast(x, tw, ids, gate_up, down, bias, act)
        gu, dn = gate_up.dequantize(), down.dequantize()
    want = np.zeros((T, D), np.float32)  # dense, token by token
    act_ref = get_op("clamped_swiglu", "numpy")
    for t in range(T):
        for a in range(A):
            e = ids[t, a]
            h = act_ref((gu[e] @ x[t] + bias[0][e])[None], 1.702, 7.0)[0]
            want[t] += tw[t, a] * (dn[e] @ h + bias[1][e])
    close_moe(got, want, what=f"{spec} T={T}", tc=rounds_operands(backend))


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("spec", QUANT_SPECS)
def test_qlinear(both, backend, spec, T):
    ref, fast = both("qlinear")
    runs = quant_case(backend, spec)
    N, K = 41, 128
    w = quantized(spec, (N, K))
    x = normal(T, K)
    if not runs:
        return refused(lambda: fast(x, w), spec)
    want = ref(x, w)
    if get_format(spec).act_quant is None:
        close_moe(want, x @ w.dequantize().T, what="qlinear reference")
    close_moe(fast(x, w), want, what=f"qlinear {spec}", tc=rounds_operands(backend))


@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_qlinear_and_the_expert_gemv_share_one_build(activations):
    """qlinear's cached segment arrays and the ones moe_gemm makes per call are of one flavour, so one compiled
    kernel serves both: read-only ones compiled every format's GEMV (and igemm's) a second time (~5 s each)."""
    from toolkit.cpu import igemm as ig, moe_gemm as mg, qlinear as ql

    fmt = get_format("int4-g64")
    w2, w3 = quantized("int4-g64", (32, 128)), quantized("int4-g64", (2, 32, 128))
    x = normal(2, 128)
    ql.qlinear(x[:1], w2, activations=activations)
    mg.expert_rows(x, w3, np.array([1, 0]), np.ones(2, np.float32), activations=activations)
    if activations == "f32":
        kernel = mg.kernel_for(fmt).prepare(w2).gemv_kernel.serial
        segs = slice(3, 8)  # seg_e, seg_lo, seg_hi, slot, scale (toolkit/cpu/gemv.py _gemv)
    else:
        kernel = ig._compiled_gemv(ig.packed(w2).bits, ig.packed(w2).kind).serial
        segs = slice(9, 15)  # xrow, slot, rscale, seg_e, seg_lo, seg_hi (toolkit/cpu/igemm.py _igemv)
    flavours = {sig[segs] for sig in kernel.signatures}
    assert len(flavours) == 1, flavours


# ---- igemm: the grouped GEMM on int8 activations and integer weight codes (spec: toolkit/ref/igemm.py) -------------
# Exact with power-of-two scales (every step of both sides exact in f32: a wrong code, offset, block or group
# shows); with real scales within the spec's ``error_bound`` (a recursive f32 sum of B + G terms)
IGEMM_SPECS = ["int8", "int4-g32", "int4-g64", "int4-g128", "int3-g32", "int3-g64", "int2-g64", "int2-g128", "q8_0",
               "q4_0", "q4_k"]
# (rows per segment: expert ids in segment order with their row counts, N, K): 1 token, odd N, K at group
# edges (one group of 128, three of 32), stacked experts with uneven / single rows, rows not a multiple of 4
IGEMM_SHAPES = [({0: 1}, 16, 128), ({0: 3}, 33, 128), ({1: 2, 0: 5}, 7, 384), ({2: 1, 0: 6, 3: 9}, 48, 256),
                ({0: 13}, 1, 128), ({1: 4, 2: 8}, 40, 512)]
IGEMM_SHAPES_G32 = [({0: 2}, 16, 32), ({0: 5, 1: 3}, 9, 96)]  # K below 128: formats with groups of 32 only
# super-blocks of 256 (q4_K): the same cases at K a multiple of 256, three super-blocks (8 blocks each) among them
IGEMM_SHAPES_K256 = [({0: 1}, 16, 256), ({0: 3}, 33, 256), ({1: 2, 0: 5}, 7, 768), ({2: 1, 0: 6, 3: 9}, 48, 256),
                     ({0: 13}, 1, 256), ({1: 4, 2: 8}, 40, 512)]


def _igemm_shapes(spec):
    fmt = get_format(spec)
    if fmt.block and fmt.block[0] == 256:
        return IGEMM_SHAPES_K256
    return IGEMM_SHAPES + (IGEMM_SHAPES_G32 if (fmt.group_size or 32) == 32 else [])


# (format, rows, N, K): every format at its shapes
IGEMM_CASES = [(spec, *shape) for spec in IGEMM_SPECS for shape in _igemm_shapes(spec)]
# Mixtral's real shapes at a few tokens (one expert: the NumPy oracle's int64 products stay small)
IGEMM_REAL = [("q4_0", {0: 3}, 14336, 4096), ("int4-g128", {0: 5}, 4096, 14336), ("q8_0", {0: 2}, 14336, 4096),
              ("q4_k", {0: 3}, 14336, 4096)]


def segments(rows_per_expert: dict):
    """{expert: rows} in order -> seg_e, seg_lo, seg_hi [S]."""
    e = np.array(list(rows_per_expert), np.int64)
    n = np.array(list(rows_per_expert.values()), np.int64)
    hi = np.cumsum(n)
    return e, hi - n, hi


def pow2_weight(spec, shape) -> QTensor:
    """Random codes with power-of-two scales and offsets: every product and sum of the GEMM exact in f32."""
    fmt = get_format(spec)
    arrays = {}
    for name, a in fmt.arrays(shape).items():
        dt = np.dtype(a.dtype)
        if dt.kind == "f":  # scales (and affine offsets) 1 or 1/2, offsets with a sign
            v = np.exp2(-RNG.integers(0, 2, a.shape)).astype(dt)
            arrays[name] = v * (RNG.choice([-1, 1], a.shape).astype(dt) if name == "biases" else 1)
        elif dt == np.int8:
            arrays[name] = RNG.integers(-128, 128, a.shape, dtype=np.int8)  # -128 too: the +128 bias edge
        else:
            arrays[name] = RNG.integers(0, 256, a.shape, dtype=np.uint8)
    if fmt.kind == "block":
        blk = arrays["blocks"].reshape(*shape[:-1], shape[-1] // 32, -1)
        blk[..., :2] = np.exp2(-RNG.integers(0, 2, blk.shape[:-1])).astype(np.float16)[..., None].view(np.uint8)
    if fmt.name == "q4_k":  # d and dmin 1 or 1/2; the 12 scale bytes & 3: every 6-bit sc and m 0..3
        blk = arrays["blocks"].reshape(*shape[:-1], shape[-1] // 256, 144)
        for at in (0, 2):
            blk[..., at:at + 2] = np.exp2(-RNG.integers(0, 2, blk.shape[:-1])).astype(np.float16)[..., None].view(np.uint8)
        blk[..., 4:16] &= 3
    return QTensor(fmt, tuple(shape), arrays)


def igemm_case(spec, rows, N, K, exact):
    """igemm's arguments: (codes, scales, w, seg_e, seg_lo, seg_hi). ``exact``: power-of-two scales and codes
    small enough that every partial sum, in any order, is exact in f32; else Gaussian activations through the
    spec's quantizer and quantized Gaussian weights."""
    from toolkit.ref import igemm as ref

    seg_e, seg_lo, seg_hi = segments(rows)
    R, E = int(seg_hi[-1]), max(rows) + 1
    if not exact:
        return (*ref.quantize_act(normal(R, K)), quantized(spec, (E, N, K), scale=0.05), seg_e, seg_lo, seg_hi)
    code_max = 127 if K <= 128 else 31
    codes = RNG.integers(-code_max, code_max + 1, (R, K)).astype(np.int8)
    scales = np.exp2(-RNG.integers(0, 2, (R, K // 32))).astype(np.float32)
    args = (codes, scales, pow2_weight(spec, (E, N, K)), seg_e, seg_lo, seg_hi)
    # precondition: every term is a multiple of 2^-2 (scales 1 or 1/2) and the terms' magnitudes sum below 2^22
    assert ref.term_magnitude(*args)[0].max() < 2.0 ** 22
    return args


def case_id(case):
    spec, rows, N, K = case
    return f"{spec}-{'+'.join(f'{e}x{n}' for e, n in rows.items())}-N{N}-K{K}"


@pytest.mark.parametrize("case", IGEMM_CASES, ids=case_id)
def test_igemm_exact_with_power_of_two_scales(both, case):
    ref, fast = both("igemm")
    args = igemm_case(*case, exact=True)
    assert_close(fast(*args), ref(*args), exact=True, what=case_id(case))


@pytest.mark.parametrize("case", IGEMM_CASES + IGEMM_REAL, ids=case_id)
def test_igemm_within_bound(both, case):
    from toolkit.ref.igemm import error_bound

    ref, fast = both("igemm")
    args = igemm_case(*case, exact=False)
    want, got = ref(*args), fast(*args)
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - want)
    bound = error_bound(*args)
    assert np.all(err <= bound), f"{case_id(case)}: max err / bound {(err / bound).max():.3g}"
