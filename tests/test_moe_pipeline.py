"""The quantized MoE pipeline's Numba stages (moe_align, moe_gemm, moe_combine) against their NumPy references,
over module-level shape tables x every registry format, and the Numba backend's own paths (the GEMM's decode /
prefill choice, int8 activations, fused_moe at Mixtral's expert shape). fused_moe and qlinear against their
references on every backend: tests/test_ops.py.

Tolerances: routing layouts exact; products in f32 within ``TOL`` of the output's scale (both sides decode
the same codes to the same f32 values, only the summation order differs). fp8 (W8A8) compares against
the reference W8A8 path (activations quantized per row), not against f32 math.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close
from toolkit.cpu import moe_gemm as cpu_moe_gemm
from toolkit.formats import FORMATS, get_format
from toolkit.ops import get_op

RNG = np.random.default_rng(0)
TOL = 2e-5  # |err| <= TOL * max|reference| + 1e-6: f32 sums over K <= 14336 in another order

# every registry format, group-wise ones at every group size; GGML's q4_1 / q5_* and k-quants (K a multiple of 256)
# have their own table in tests/test_kquant.py
SPECS = [f"{f.name}-g{g}" for f in FORMATS.values() for g in f.group_sizes] + \
        [f.name for f in FORMATS.values() if not f.group_sizes and f.kind != "ggml"]
# (T, E, A, block_m): one token, top-k = E, experts with no token, all tokens to one expert, many rows
ALIGN_SHAPES = [(1, 8, 2, 4), (6, 4, 4, 16), (3, 16, 2, 4), (9, 4, 1, 8), (40, 8, 2, 16), (128, 8, 2, 64)]
# (T, E, A, N, K), K a multiple of the largest group (128): one token, top-k = E, sparse experts, odd N,
# 2-3 rows per expert (fused affine decode-and-dot over several rows), prefill-sized (> 8 rows per expert)
GEMM_SHAPES = [(1, 8, 2, 33, 128), (5, 4, 4, 24, 256), (3, 16, 2, 7, 128), (7, 3, 1, 9, 256), (40, 4, 2, 48, 128)]
# Mixtral's expert shape with a reduced expert count (a full E=8 layer is too big for the NumPy oracle)
# (T, E, A, D, I, format)
MIXTRAL = [(2, 2, 1, 4096, 14336, "int4-g128")]


def routing(T, E, A, one_expert=False):
    if one_expert:
        ids = np.zeros((T, A), np.int32) + np.arange(A, dtype=np.int32)  # slot a -> expert a; A=1: all on 0
    else:
        ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)  # [T, A] distinct per token
    w = RNG.random((T, A)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def quantized(spec, shape, scale=0.1):
    return get_format(spec).quantize((RNG.standard_normal(shape) * scale).astype(np.float32), "numba")


def close(actual, expected, what=""):
    assert_close(actual, expected, atol=TOL * float(np.abs(expected).max()) + 1e-6, what=what)


@pytest.mark.parametrize("shape", ALIGN_SHAPES)
def test_moe_align(shape):
    T, E, A, bm = shape
    ids, _ = routing(T, E, A, one_expert=(T == 9))
    ref = get_op("moe_align", "numpy")(ids, E, bm)
    got = get_op("moe_align", "numba")(ids, E, bm)
    assert_close(got[0], ref[0], exact=True, what="sorted_ids")
    assert_close(got[1], ref[1], exact=True, what="expert_ids")
    assert got[2] == ref[2] == ref[0].size and ref[2] % bm == 0
    flat = ids.reshape(-1)
    real = ref[0][ref[0] < flat.size]
    assert sorted(real.tolist()) == list(range(flat.size))  # every slot exactly once
    assert (flat[ref[0].reshape(-1, bm)[:, 0]] == ref[1]).all()  # a block's first slot is real, of its expert
    assert set(ref[1].tolist()) == set(flat.tolist())  # experts without tokens get no block


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_moe_combine(backend, kernel_build):
    y = RNG.standard_normal((12, 40)).astype(np.float32)
    close(get_op("moe_combine", backend)(y, 3), y.reshape(4, 3, 40).sum(1), "moe_combine")


@pytest.mark.parametrize("path", [None, "decode", "prefill"])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("spec", SPECS)
def test_moe_gemm(spec, shape, path):
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = quantized(spec, (E, N, K))
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 4)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    ref1 = get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, 4, A)
    close(get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 4, A, path=path), ref1, "GEMM1")
    xs = RNG.standard_normal((T * A, K)).astype(np.float32)  # GEMM2: one input row per slot, weighted
    ref2 = get_op("moe_gemm", "numpy")(xs, w, sorted_ids, expert_ids, 4, A, tw, x_is_slots=True)
    got2 = get_op("moe_gemm", "numba")(xs, w, sorted_ids, expert_ids, 4, A, tw, x_is_slots=True, path=path)
    close(got2, ref2, "GEMM2")


@pytest.mark.parametrize("shape", MIXTRAL)
def test_fused_moe_mixtral_shape(shape):
    T, E, A, D, I, spec = shape
    fmt = get_format(spec)
    ids, tw = routing(T, E, A)

    def experts(n, k):  # quantized expert by expert: never all experts in f32 at once
        qs = [fmt.quantize(RNG.standard_normal((n, k), dtype=np.float32) * np.float32(0.02), "numba") for _ in range(E)]
        stacked = type(qs[0])(fmt, (E, n, k), {a: np.stack([q.arrays[a] for q in qs]) for a in qs[0].arrays})
        dense = np.zeros((E, n, k), np.float32)  # the oracle's weights: only routed experts decoded
        for e in np.unique(ids):
            dense[e] = qs[e].dequantize("numba")
        return stacked, dense

    (gate_up, gu), (down, dn) = experts(2 * I, D), experts(D, I)
    x = RNG.standard_normal((T, D)).astype(np.float32)
    got = get_op("fused_moe", "numba")(x, tw, ids, gate_up, down)
    close(got, get_op("moe_experts", "numba")(x, ids, tw, gu, dn), f"Mixtral-shape fused_moe {spec}")


def test_numba_path_choice_covers_decode_and_prefill(monkeypatch):
    """Few rows per expert run the GEMV kernel, many rows the tiled BLAS path, both in one call."""
    kern, calls = cpu_moe_gemm.kernel_for(get_format("int4")), []
    for name, path in (("gemv", "decode"), ("decode_tile", "prefill")):
        real = getattr(kern, name)
        monkeypatch.setattr(kern, name, lambda *a, real=real, path=path: (calls.append(path), real(*a))[1])
    many = cpu_moe_gemm.decode_max_rows() + 12  # the threshold at this thread count (8 on one, 64 on more)
    ids = np.array([[0]] * many + [[1]] * 2, np.int32)  # expert 0: many rows (prefill), expert 1: 2 rows (decode)
    w = quantized("int4", (2, 16, 64))
    x = RNG.standard_normal((many + 2, 64)).astype(np.float32)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numba")(ids, 2, 16)
    got = get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 16, 1)
    assert set(calls) == {"decode", "prefill"}
    close(got, get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, 16, 1), "mixed paths")


# ---- opt-in int8 activations (--activations int8: toolkit/cpu/igemm.py) ---------------------------------
# Spec: every input row quantized to 8-bit blocks of 32 along K (``toolkit/ref/igemm.py``), then the f32
# reference on those dequantized rows; decode-sized and prefill-sized segments alike, GEMM1 and GEMM2.
INT8_SPECS = ["int8", "int4-g32", "int4-g128", "int3-g64", "int2-g64", "q4_0", "q8_0"]
INT8_SHAPES = [(1, 8, 2, 33, 256), (5, 4, 4, 24, 512), (40, 4, 2, 48, 128)]


def x_hat(x):
    from toolkit.ref import igemm as ref_igemm
    return ref_igemm.dequant_act(*ref_igemm.quantize_act(x))


@pytest.mark.parametrize("shape", INT8_SHAPES)
@pytest.mark.parametrize("spec", INT8_SPECS)
def test_moe_gemm_int8_activations(spec, shape):
    T, E, A, N, K = shape
    ids, tw = routing(T, E, A)
    w = quantized(spec, (E, N, K))
    assert cpu_moe_gemm.int8_applies(w, "int8"), f"{spec}: the int8 path does not apply"
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 4)
    for x_is_slots in (False, True):
        x = RNG.standard_normal((T * A if x_is_slots else T, K)).astype(np.float32)
        args = (sorted_ids, expert_ids, 4, A) + ((tw,) if x_is_slots else ())
        ref = get_op("moe_gemm", "numpy")(x_hat(x), w, *args, x_is_slots=x_is_slots)
        got = get_op("moe_gemm", "numba")(x, w, *args, x_is_slots=x_is_slots, activations="int8")
        close(got, ref, f"int8 activations {spec} x_is_slots={x_is_slots}")
        exact32 = get_op("moe_gemm", "numba")(x, w, *args, x_is_slots=x_is_slots)
        assert np.abs(got - exact32).max() > 0, "the int8 path must differ from f32 activations somewhere"


@pytest.mark.parametrize("spec", ["int4-g128", "q4_0", "q8_0"])
def test_int8_activations_decode_step_and_qlinear(spec):
    """The decode step's MoE (one token, no alignment) and qlinear take the same int8 activations: the kind the
    weights were prepared for (prepare_weight, as a load does)."""
    E, A, D, I = 4, 2, 128, 256
    ids, tw = routing(1, E, A)
    gate_up, down = quantized(spec, (E, 2 * I, D)), quantized(spec, (E, D, I))
    gate_up, down = cpu_moe_gemm.prepare_weight(gate_up, "int8"), cpu_moe_gemm.prepare_weight(down, "int8")
    x = RNG.standard_normal((1, D)).astype(np.float32)
    got = get_op("fused_moe", "numba")(x, tw, ids, gate_up, down)
    h = get_op("moe_gemm", "numpy")(x_hat(x), gate_up, *get_op("moe_align", "numpy")(ids, E, 4)[:2], 4, A)
    h = get_op("silu_and_mul", "numpy")(h)
    sid, eid, _ = get_op("moe_align", "numpy")(ids, E, 4)
    y = get_op("moe_gemm", "numpy")(x_hat(h), down, sid, eid, 4, A, tw, x_is_slots=True)
    close(got, y.reshape(1, A, D).sum(1), f"decode-step fused_moe {spec}")
    w = cpu_moe_gemm.prepare_weight(quantized(spec, (41, 128)), "int8")
    xs = RNG.standard_normal((3, 128)).astype(np.float32)
    close(get_op("qlinear", "numba")(xs, w), get_op("qlinear", "numpy")(x_hat(xs), w), f"qlinear {spec}")


def test_a_weight_never_prepared_takes_f32_activations():
    """The kind is the weight's (chosen where the layer is built): an unprepared weight runs exact f32 activations,
    an explicit argument wins over the recorded kind, and prepare_weight refuses an unknown kind."""
    w = quantized("q4_0", (8, 64))
    assert not cpu_moe_gemm.int8_applies(w) and cpu_moe_gemm.int8_applies(w, "int8")
    cpu_moe_gemm.prepare_weight(w, "int8")
    assert cpu_moe_gemm.prepared_kind(w) == "int8" and cpu_moe_gemm.int8_applies(w)
    assert not cpu_moe_gemm.int8_applies(w, "f32")
    with pytest.raises(ValueError, match="activations must be one of f32, int8"):
        cpu_moe_gemm.prepare_weight(quantized("q4_0", (8, 64)), "int4")


@pytest.mark.parametrize("spec", ["fp8", "f16"])
def test_int8_activations_leave_other_formats_alone(spec):
    """fp8 (its own W8A8 scheme) and 16-bit weights keep their path: the result is unchanged."""
    w = quantized(spec, (2, 16, 128))
    assert not cpu_moe_gemm.int8_applies(w, "int8")
    ids = np.array([[0, 1]], np.int32)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, 2, 4)
    x = RNG.standard_normal((1, 128)).astype(np.float32)
    got = get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 4, 2, activations="int8")
    assert_close(got, get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 4, 2), exact=True, what=spec)
