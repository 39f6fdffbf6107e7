"""The MoE pipeline's Numba-only paths, which get_op's common signature does not name: moe_gemm with its decode
(GEMV) and prefill (tiled BLAS) kernels forced, the per-expert choice between them, and the opt-in int8
activations (moe_gemm, the decode step's fused_moe, qlinear). Every MoE op on every backend against its NumPy
reference (moe_align, moe_gemm, moe_combine, fused_moe at Mixtral's expert shape, qlinear): tests/test_ops_moe.py,
whose shape tables, formats and tolerance these tests share.

Tolerances: products in f32 within ``MOE_TOL`` of the output's scale (``close_moe``: both sides decode the same
codes to the same f32 values, only the summation order differs); int8 activations against the f32 reference on
the dequantized activations.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close
from test_ops_moe import GEMM_SHAPES, QUANT_SPECS, close_moe, moe_gemm_cases, moe_routing, quantized
from toolkit.cpu import moe_gemm as cpu_moe_gemm
from toolkit.formats import get_format
from toolkit.ops import get_op

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("spec", QUANT_SPECS)
def test_moe_gemm_forced_path(spec, shape, path):
    """Each kernel on every expert, whatever its row count (the default choice: tests/test_ops_moe.py)."""
    for what, args in moe_gemm_cases(spec, shape):
        got = get_op("moe_gemm", "numba")(*args, path=path)
        close_moe(got, get_op("moe_gemm", "numpy")(*args), what=f"{what} {spec} {path}")


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
    close_moe(got, get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, 16, 1), what="mixed paths")


def test_only_16bit_weights_read_their_rows_one_by_one():
    """The one-row-at-a-time GEMV (``gemv._dot1``) is the 16-bit formats' only: a dense f32 weight keeps the 4-row
    template, whose bits the compiled decode step's ``gemv_f32`` gives (tests/test_parity_hf.py)."""
    from toolkit.cpu.decoders import decoder_for

    got = {spec: decoder_for(get_format(spec)).row_by_row for spec in ("f16", "bf16", "f32", "q4_0", "int4", "int8")}
    assert got == {"f16": True, "bf16": True, "f32": False, "q4_0": False, "int4": False, "int8": False}


@pytest.mark.parametrize("L,one_by_one", [(8, True), (16, False)])
def test_16bit_rows_one_by_one_at_8_lanes_interleaved_at_16(L, one_by_one):
    """A 16-bit weight's one-token GEMV reads its rows one after another on AVX2 (8 lanes) and as 4 interleaved
    row streams on AVX-512 (16 lanes), each measured the faster there (gemv.ROW_BY_ROW_LANES)."""
    from toolkit.cpu.decoders import decoder_for
    from toolkit.cpu.gemv import _bindings

    for spec in ("f16", "bf16"):
        both, _ = _bindings(decoder_for(get_format(spec)), L, 1)
        assert ("DOT1" in both) is one_by_one, (spec, L)


@pytest.mark.parametrize("spec", ["f16", "bf16"])
def test_a_16bit_weight_takes_gemm16_from_a_few_rows_on_any_thread_count(spec, monkeypatch):
    """A 16-bit dense weight (attention's projections, the head) at prefill: from DECODE_MAX_ROWS rows on, on two
    threads too, the product straight from its stored bits (toolkit/cpu/gemm16.py): no GEMV, no widened tile
    (widening into tiles for BLAS took 12 of Mixtral's 65 ms of q|k|v and o at 64 rows); the reference's product."""
    from toolkit.cpu import gemm16
    from toolkit.threads import set_threads, threads

    kern, calls = cpu_moe_gemm.kernel_for(get_format(spec)), []
    monkeypatch.setattr(kern, "gemv", lambda *a: calls.append("gemv"))  # (returns nothing: fails if it runs)
    monkeypatch.setattr(kern, "decode_tile", lambda *a: calls.append("tile"))
    real = gemm16.gemm16
    monkeypatch.setattr(gemm16, "gemm16", lambda x, w, *a: (calls.append(w.shape), real(x, w, *a))[1])
    before = threads()
    try:
        set_threads(2)
        assert cpu_moe_gemm.decode_max_rows(widening=True) == cpu_moe_gemm.DECODE_MAX_ROWS
        assert cpu_moe_gemm.decode_max_rows() == cpu_moe_gemm.DECODE_MAX_ROWS_PARALLEL
        w = get_format(spec).quantize(RNG.standard_normal((600, 1024)).astype(np.float32), "numpy", name="w")
        x = RNG.standard_normal((cpu_moe_gemm.DECODE_MAX_ROWS + 1, 1024)).astype(np.float32)
        got = get_op("qlinear", "numba")(x, w)
    finally:
        set_threads(before)
    assert calls == [(600, 1024)], calls  # one call over every row
    np.testing.assert_allclose(got, get_op("qlinear", "numpy")(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("spec", ["f32", "q4_0", "int4"])  # 16-bit weights: gemm16
def test_prefill_tiles_are_shared_by_the_threads_with_one_threads_bits(spec, monkeypatch):
    """On two threads each Python thread decodes every other tile into its own scratch and multiplies it on one
    BLAS thread (decodes overlap products): every tile decoded once, by both threads between them, and the product
    bit-identical to one thread's (BLAS never splits K)."""
    import threading

    from toolkit.threads import set_threads, threads

    kern, seen = cpu_moe_gemm.kernel_for(get_format(spec)), []
    real = kern.decode_tile
    monkeypatch.setattr(kern, "decode_tile",
                        lambda wt, e, n0, t: (seen.append((n0, threading.get_ident())), real(wt, e, n0, t))[1])
    w = get_format(spec).quantize(RNG.standard_normal((1100, 1024)).astype(np.float32) * 0.1, "numpy", name="w")
    x = RNG.standard_normal((cpu_moe_gemm.DECODE_MAX_ROWS_PARALLEL + 16, 1024)).astype(np.float32)  # tiled on 2 too
    before, got = threads(), {}
    try:
        for n in (1, 2):
            set_threads(n)
            seen.clear()
            got[n] = get_op("qlinear", "numba")(x, w, activations="f32")
            assert sorted(n0 for n0, _ in seen) == [0, 256, 512, 768, 1024], seen  # 5 tiles of 256 rows
            assert len({t for _, t in seen}) == n, seen
    finally:
        set_threads(before)
    assert np.array_equal(got[1], got[2])
    np.testing.assert_allclose(got[2], get_op("qlinear", "numpy")(x, w), rtol=1e-4, atol=1e-4)


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
    ids, tw = moe_routing(T, E, A)
    w = quantized(spec, (E, N, K))
    assert cpu_moe_gemm.int8_applies(w, "int8"), f"{spec}: the int8 path does not apply"
    sorted_ids, expert_ids, _ = get_op("moe_align", "numpy")(ids, E, 4)
    for x_is_slots in (False, True):
        x = RNG.standard_normal((T * A if x_is_slots else T, K)).astype(np.float32)
        args = (sorted_ids, expert_ids, 4, A) + ((tw,) if x_is_slots else ())
        ref = get_op("moe_gemm", "numpy")(x_hat(x), w, *args, x_is_slots=x_is_slots)
        got = get_op("moe_gemm", "numba")(x, w, *args, x_is_slots=x_is_slots, activations="int8")
        close_moe(got, ref, what=f"int8 activations {spec} x_is_slots={x_is_slots}")
        exact32 = get_op("moe_gemm", "numba")(x, w, *args, x_is_slots=x_is_slots)
        assert np.abs(got - exact32).max() > 0, "the int8 path must differ from f32 activations somewhere"


@pytest.mark.parametrize("spec", ["int4-g128", "q4_0", "q8_0"])
def test_int8_activations_decode_step_and_qlinear(spec):
    """The decode step's MoE (one token, no alignment) and qlinear take the same int8 activations: the kind the
    weights were prepared for (prepare_weight, as a load does)."""
    E, A, D, I = 4, 2, 128, 256
    ids, tw = moe_routing(1, E, A)
    gate_up, down = quantized(spec, (E, 2 * I, D)), quantized(spec, (E, D, I))
    gate_up, down = cpu_moe_gemm.prepare_weight(gate_up, "int8"), cpu_moe_gemm.prepare_weight(down, "int8")
    x = RNG.standard_normal((1, D)).astype(np.float32)
    got = get_op("fused_moe", "numba")(x, tw, ids, gate_up, down)
    h = get_op("moe_gemm", "numpy")(x_hat(x), gate_up, *get_op("moe_align", "numpy")(ids, E, 4)[:2], 4, A)
    h = get_op("silu_and_mul", "numpy")(h)
    sid, eid, _ = get_op("moe_align", "numpy")(ids, E, 4)
    y = get_op("moe_gemm", "numpy")(x_hat(h), down, sid, eid, 4, A, tw, x_is_slots=True)
    close_moe(got, y.reshape(1, A, D).sum(1), what=f"decode-step fused_moe {spec}")
    w = cpu_moe_gemm.prepare_weight(quantized(spec, (41, 128)), "int8")
    xs = RNG.standard_normal((3, 128)).astype(np.float32)
    close_moe(get_op("qlinear", "numba")(xs, w), get_op("qlinear", "numpy")(x_hat(xs), w), what=f"qlinear {spec}")


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
