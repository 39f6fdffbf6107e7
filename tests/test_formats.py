"""Formats: registry facts, Numba == NumPy reference (bit for bit), external oracles, declared error bounds."""
from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from helpers import assert_close
from toolkit.errors import BackendError, FormatError
from toolkit.formats import FORMATS, get_format

# ---- tables ------------------------------------------------------------------------------------------
# every format spec a user can ask for (group-wise ones at every allowed group size); GGML's q4_1 / q5_* and k-quants
# (kind "ggml", super-blocks of 256 that these shapes do not fit) have their own table: tests/test_kquant.py
BASE = {n: f for n, f in FORMATS.items() if f.kind != "ggml"}
SPECS = [f.name for f in BASE.values() if not f.group_sizes] + [
    f"{f.name}-g{g}" for f in BASE.values() for g in f.group_sizes
]
# [..., N, K]: one row, odd row counts, stacked experts, K spanning several groups of 128
SHAPES = [(1, 128), (3, 256), (2, 5, 128), (7, 384)]
# stored bits per weight (scales and offsets included) at K = 4096
BITS_PER_WEIGHT = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, "int8": 8 + 32 / 4096, "fp8": 8 + 32 / 4096,
    "int4-g32": 5.0, "int4-g64": 4.5, "int4-g128": 4.25, "int3-g32": 4.0, "int3-g64": 3.5, "int3-g128": 3.25,
    "int2-g32": 3.0, "int2-g64": 2.5, "int2-g128": 2.25, "q8_0": 8.5, "q4_0": 4.5, "mxfp4": 4.25,
}


def _group_reduce(x: np.ndarray, g: int, fn) -> np.ndarray:
    """fn over groups of g along the last axis, broadcast back to x's shape."""
    xs = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    return np.broadcast_to(fn(xs, axis=-1, keepdims=True), xs.shape).reshape(x.shape).astype(np.float64)


def _affine_bound(bits):
    def bound(w, g):
        qmax = (1 << bits) - 1
        rng = _group_reduce(w, g, np.max) - _group_reduce(w, g, np.min)
        amax = _group_reduce(np.abs(w), g, np.max)
        # half a step, plus the f16 rounding of scale and offset, plus the f16 subnormal quantum
        return 0.5 * rng / qmax * (1 + 2**-10) + 3 * 2**-11 * amax + (qmax + 1) * 2**-24

    return bound


F32_TINY = 2**-140  # f32 arithmetic on subnormal scales rounds to multiples of 2**-149

# Declared round-trip error bound per element, derived from each format's definition.
ERROR_BOUND = {
    "f32": lambda w, g: np.zeros(w.shape),
    "f16": lambda w, g: 2**-11 * np.abs(w) + 2**-25,
    "bf16": lambda w, g: 2**-8 * np.abs(w) + 2**-133,  # half an ulp; bf16 subnormal quantum is 2**-133
    "int8": lambda w, g: 0.5 * _group_reduce(np.abs(w), w.shape[-1], np.max) / 127 * (1 + 2**-20) + F32_TINY,
    "fp8": lambda w, g: 2**-4 * np.abs(w) + 2**-10 * _group_reduce(np.abs(w), w.shape[-1], np.max) / 448 + F32_TINY,
    "int4": _affine_bound(4), "int3": _affine_bound(3), "int2": _affine_bound(2),
    "q8_0": lambda w, g: _group_reduce(np.abs(w), 32, np.max) / 127 * (0.5 + 128 * 2**-11) + 128 * 2**-24,
    "q4_0": lambda w, g: _group_reduce(np.abs(w), 32, np.max) / 8 * (1 + 16 * 2**-11) + 16 * 2**-24,
    # scale X = 2**(floor(log2 absmax) - 2) <= absmax / 4: values past 6X saturate (at most absmax - 6X <= absmax / 4
    # since 6X > 3/4 absmax), below it half a step (<= X); plus the subnormal quantum of the smallest scales
    "mxfp4": lambda w, g: _group_reduce(np.abs(w), 32, np.max) / 4 + 2**-127,
}
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "mxfp4": gguf.GGMLQuantizationType.MXFP4}


def _weights(shape, seed=0, scale=0.02):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# ---- registry ----------------------------------------------------------------------------------------
def test_registry_names_unique_and_bounds_declared():
    assert all(get_format(name) is f for name, f in FORMATS.items())
    assert set(ERROR_BOUND) == set(BASE), "every format needs a declared error bound (ggml kinds: test_kquant.py)"


@pytest.mark.parametrize("spec", SPECS)
def test_bits_per_weight(spec):
    assert get_format(spec).bits_per_weight((4096, 4096)) == pytest.approx(BITS_PER_WEIGHT[spec], abs=1e-12)


@pytest.mark.parametrize("spec", ["int4-g128", "int3-g32", "int2-g64"])
def test_group_size_parameter(spec):
    name, g = spec.split("-g")
    assert get_format(name, int(g)) == get_format(spec)
    assert get_format(spec).spec == spec


@pytest.mark.parametrize("bad", ["int5", "int4-g48", "q4_2", "q4_k-g32", ""])
def test_unknown_format_is_a_clear_error(bad):
    with pytest.raises(FormatError, match="format"):
        get_format(bad)


# ---- Numba == NumPy reference, bit for bit -----------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spec", SPECS)
def test_numba_matches_reference(spec, shape):
    fmt = get_format(spec)
    w = _weights(shape, seed=len(shape) * 7 + shape[-1])
    ref, fast = fmt.quantize(w, "numpy"), fmt.quantize(w, "numba")
    for key in ref.arrays:
        assert_close(fast.arrays[key], ref.arrays[key], exact=True, what=f"{spec} {key}")
    assert_close(fast.dequantize("numba"), ref.dequantize("numpy"), exact=True, what=f"{spec} dequantize")
    assert ref.nbytes == fmt.nbytes(shape)


@pytest.mark.parametrize("spec", list(GGUF_TYPES))
@pytest.mark.parametrize("shape", SHAPES + [(4, 32)])
def test_ggml_blocks_equal_gguf_package(spec, shape):
    w = _weights(shape, seed=3, scale=1.0)
    w.reshape(-1)[::7] *= 40  # outliers, and both signs of the largest magnitude
    oracle = gguf.quants.quantize(w, GGUF_TYPES[spec])
    for backend in ("numpy", "numba"):
        qt = get_format(spec).quantize(w, backend)
        assert_close(qt.arrays["blocks"], oracle, exact=True, what=f"{spec} {backend} bytes")
        assert_close(qt.dequantize(backend), gguf.quants.dequantize(oracle, GGUF_TYPES[spec]).astype(np.float32),
                     exact=True, what=f"{spec} {backend} dequantize")


# ---- round trip within the declared bound (property tests) ------------------------------------------
GROUPS = st.sampled_from(["gauss", "zeros", "constant", "outlier", "denormal", "mixed"])


@st.composite
def weight_rows(draw):
    kind = draw(GROUPS)
    n = draw(st.integers(1, 3))
    k = 128 * draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if kind == "zeros":
        w[:] = 0
    elif kind == "constant":
        w[:] = np.float32(draw(st.floats(-100, 100, width=32)))
    elif kind == "outlier":
        w.reshape(-1)[rng.integers(0, w.size, 3)] = np.float32(draw(st.sampled_from([1e3, -2e4, 6e4])))
    elif kind == "denormal":
        w *= np.float32(1e-39)
    elif kind == "mixed":
        w = draw(hnp.arrays(np.float32, (n, k), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=True)))
    return w


@pytest.mark.parametrize("spec", SPECS)
@given(w=weight_rows())
def test_round_trip_within_declared_bound(spec, w):
    fmt = get_format(spec)
    back = fmt.quantize(w, "numba").dequantize("numba")
    bound = ERROR_BOUND[fmt.name](w.astype(np.float64), fmt.group_size)
    err = np.abs(back.astype(np.float64) - w)
    assert np.all(err <= bound), f"{spec}: max excess {np.max(err - bound):.3g} at {np.unravel_index(np.argmax(err - bound), w.shape)}"


# ---- scalar codecs against their oracles ----------------------------------------------------------------
def _boundary_values(decoded: np.ndarray) -> np.ndarray:
    """Every representable value, the midpoints between neighbours, and one f32 ulp either side."""
    v = np.unique(decoded[np.isfinite(decoded)].astype(np.float32))
    mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    cands = np.concatenate([v, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
    return np.concatenate([cands, -cands]).astype(np.float32)


def test_e4m3_encoder_matches_ml_dtypes():
    from toolkit.formats.scalar import E4M3_TO_F32, e4m3_encode_array, e4m3_encode_ref

    x = np.concatenate([_boundary_values(E4M3_TO_F32),
                        np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 50]).astype(np.float32)
    out = np.empty(x.shape, np.uint8)
    e4m3_encode_array(x, out)
    assert_close(out, e4m3_encode_ref(x), exact=True, what="numba vs reference")
    inside = np.abs(x) <= 448
    assert_close(out[inside], x[inside].astype(ml_dtypes.float8_e4m3fn).view(np.uint8), exact=True, what="vs ml_dtypes")
    special = np.array([1000.0, -1000.0, np.inf, -np.inf, np.nan, -0.0, 464.0], np.float32)
    e4m3_encode_array(special, out[:7])
    assert out[:7].tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0x80, 0x7E]  # saturation, NaN kept, -0 kept


def test_f16_encoder_matches_numpy():
    from toolkit.formats.scalar import f16_decode_array, f16_encode_array

    all_halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    x = np.concatenate([_boundary_values(all_halves), np.array([7e4, -7e4, np.inf, np.nan, -0.0], np.float32)])
    out = np.empty(x.shape, np.uint16)
    f16_encode_array(x, out)
    with np.errstate(over="ignore"):
        assert_close(out, x.astype(np.float16).view(np.uint16), exact=True, what="f32 -> f16 bits")
    dec = np.empty(65536, np.float32)
    f16_decode_array(np.arange(65536, dtype=np.uint16), dec)
    nan = np.isnan(all_halves)
    assert np.array_equal(np.isnan(dec), nan)  # NaN payloads are not kept (scales are never NaN)
    assert_close(dec[~nan], all_halves[~nan], exact=True, what="f16 bits -> f32")


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_packing_round_trip(bits, backend):
    from toolkit.formats import packing

    pack, unpack = {"numpy": (packing.pack_ref, packing.unpack_ref), "numba": (packing.pack_numba, packing.unpack_numba)}[backend]
    q = np.random.default_rng(bits).integers(0, 1 << bits, (5, 96), dtype=np.uint8)
    p = pack(q, bits)
    assert p.shape == (5, 96 * bits // 8)
    assert_close(p, packing.pack_ref(q, bits), exact=True, what="packed bytes")
    assert_close(unpack(p, bits, 96), q, exact=True, what="unpacked codes")


def test_int3_layout_is_pinned():
    """Eight 3-bit codes 0..7 fill three bytes LSB first: the on-disk layout must never drift."""
    from toolkit.formats.packing import pack_numba

    q = np.arange(8, dtype=np.uint8)[None]
    u24 = sum(int(c) << (3 * i) for i, c in enumerate(range(8)))
    assert pack_numba(q, 3)[0].tolist() == [u24 & 0xFF, (u24 >> 8) & 0xFF, u24 >> 16] == [0x88, 0xC6, 0xFA]


def test_fp8_activation_quant_matches_reference():
    fmt = get_format("fp8")
    x = _weights((9, 256), seed=11, scale=3.0)
    qr, sr = fmt.act_quant["numpy"](x)
    qn, sn = fmt.act_quant["numba"](x)
    assert_close(qn, qr, exact=True, what="codes")
    assert_close(sn, sr, exact=True, what="scales")
    assert_close(sr, np.abs(x).max(-1) / np.float32(448), exact=True, what="per-token scale")


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["int4-g128", "int3-g64", "int2-g32", "q8_0", "q4_0", "mxfp4"])
def test_inner_dim_not_divisible_is_a_clear_error(spec):
    with pytest.raises(FormatError, match=r"'layers.0.w1'.*not divisible by the group size"):
        get_format(spec).quantize(np.ones((4, 100), np.float32), name="layers.0.w1")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_names_the_tensor(spec, bad):
    w = np.ones((2, 128), np.float32)
    w[1, 17] = bad
    with pytest.raises(FormatError, match=r"'experts.3.down_proj'.*(NaN|inf) at index \(1, 17\)"):
        get_format(spec).quantize(w, "numba", name="experts.3.down_proj")


@pytest.mark.parametrize("spec", ["f16", "int4", "int2-g32"])
def test_values_beyond_half_range_are_refused(spec):
    w = np.zeros((1, 128), np.float32)
    w[0, 0] = 1e6
    with pytest.raises(FormatError, match="'big'.*65504"):
        get_format(spec).quantize(w, name="big")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        get_format("int8").quantize(np.ones((1, 32), np.float32), backend="tpu")


# ---- mxfp4 against transformers' own gpt-oss dequantization ---------------------------------------------------
def test_mxfp4_from_gpt_oss_layout_equals_transformers_dequantization():
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    from toolkit.formats.ggml import E2M1, mxfp4_blocks_from_ocp

    assert E2M1.tolist() == [float(v) for v in mx.FP4_VALUES]
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)  # [E, N, G, 16] as gpt-oss stores them
    scales = rng.integers(100, 140, (3, 5, 4), dtype=np.uint8)
    scales[0, 0, 0] = 0  # the subnormal scale 2**-127 too
    want = mx.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    want = want.transpose(0, 2, 1)  # transformers returns [E, K, N] (gpt-oss multiplies x @ W)
    fmt = get_format("mxfp4")
    from toolkit.formats import QTensor

    qt = QTensor(fmt, (3, 5, 128), {"blocks": mxfp4_blocks_from_ocp(blocks, scales)})
    for backend in ("numpy", "numba"):
        assert_close(qt.dequantize(backend), np.ascontiguousarray(want), exact=True, what=f"mxfp4 {backend}")
