"""GGML q4_1 / q5_0 / q5_1 and the k-quants q2_K..q6_K (``toolkit/formats/kquant.py``): the block layouts against
the ``gguf`` package, the quantizers against ggml's, the Numba GEMV / tile decoders against the NumPy reference at
both SIMD widths, and the model path (``--experts q4_K``).

Oracles: ``gguf.quants.dequantize`` (every type, bit for bit), ``gguf.quants.quantize`` (q4_1 / q5_0 / q5_1) and,
where ``MOQE_LLAMA_CPP`` names a llama.cpp build, ggml's own ``ggml_quantize_chunk`` (every type, byte for byte);
without it that test skips. Kernel tolerance: ``TOL`` of the output's scale, as tests/test_moe_pipeline.py.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from helpers import assert_close
from toolkit.cpu import moe_gemm as cpu_moe_gemm
from toolkit.errors import FormatError
from toolkit.formats import FORMATS, get_format
from toolkit.formats.kquant import SPECS, dequantize_raw, fields
from toolkit.ops import get_op

NAMES = list(SPECS)
TOL = 2e-5
RNG = np.random.default_rng(7)
# round-trip error per element, as a fraction of its block's max |w|: the format's worst step at that range (half a
# step of range / levels for the min formats; a whole step, |d|, where the code range clips the far side: q5_0 d =
# amax / 16, q3_K amax / 4, q6_K amax / 32), times 1.5 for the k-quants' 6-bit (8-bit) scales and f16 rounding
STEP = {"q4_1": 1 / 15, "q5_0": 1 / 16, "q5_1": 1 / 31, "q2_k": 1 / 3, "q3_k": 1 / 4, "q4_k": 1 / 15, "q5_k": 1 / 31,
        "q6_k": 1 / 32}
# (T, E, A, N, K): one token (GEMV, 4 rows at a time), 3 rows per expert (multi-row GEMV), prefill (tile + BLAS)
GEMM_SHAPES = [(1, 4, 2, 36, 512), (3, 2, 2, 20, 256), (24, 2, 1, 16, 768)]


def weights(shape, scale=0.1):
    w = (RNG.standard_normal(shape) * scale).astype(np.float32)
    w.reshape(-1, shape[-1])[0, :256] = 0  # an all-zero super-block
    return w


def random_blocks(name, n):
    """n blocks of random bytes with finite f16 scales (and mins) where the format keeps them."""
    s = SPECS[name]
    raw = RNG.integers(0, 256, (n, s.bytes), dtype=np.uint8)
    for o in s.halves:
        raw[:, o:o + 2] = (RNG.standard_normal((n, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_equals_the_gguf_package(name):
    raw = random_blocks(name, 40)
    want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(SPECS[name].type_id)).reshape(-1)
    assert np.array_equal(dequantize_raw(name, raw), want)


@pytest.mark.parametrize("name", NAMES)
def test_fields_are_the_block_layout(name):
    """Codes within their bit width, one scale (and min) factor per group, one d per block."""
    s, raw = SPECS[name], random_blocks(name, 5)
    f = fields(name, raw)
    assert f.codes.shape == (5, s.values) and int(f.codes.max()) < 2 ** s.code_bits
    assert f.d.shape == (5,) and (f.sc is None) == (s.values == 32)
    if f.sc is not None:
        assert f.sc.shape == (5, s.values // s.group)
        assert (f.m is not None) == (s.min == "k")


def test_q4_k_blocks_invert_fields():
    """Every bit of a q4_K block is one of its fields: any 144 bytes come back byte for byte (the integer kernels keep
    q4_K taken apart and rebuild the blocks with ``q4_k_blocks`` when an export reads them)."""
    from toolkit.formats.kquant import q4_k_blocks

    raw = RNG.integers(0, 256, (64, 144), dtype=np.uint8)
    assert_close(q4_k_blocks(fields("q4_k", raw)), raw, exact=True, what="q4_K blocks")


@pytest.mark.parametrize("name", ["q4_1", "q5_0", "q5_1"])
def test_block32_quantizers_equal_the_gguf_package(name):
    w = weights((6, 512))
    got = get_format(name).quantize(w).arrays["blocks"]
    want = gguf.quants.quantize(w, gguf.GGMLQuantizationType(SPECS[name].type_id))
    assert got.shape == (6, 512 // 32 * SPECS[name].bytes) and np.array_equal(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_error_is_bounded(name):
    w = weights((8, 1024), scale=1.0) * np.geomspace(1e-3, 10, 8, dtype=np.float32)[:, None]
    back = get_format(name).quantize(w).dequantize()
    assert np.abs(back[0, :256]).max() == 0  # the zero super-block stays zero
    n = SPECS[name].values
    amax = np.abs(w).reshape(8, -1, n).max(axis=-1, keepdims=True)  # [8, blocks, 1]
    err = np.abs(back - w).reshape(8, -1, n)
    assert (err <= 1.5 * STEP[name] * amax + 1e-7).all(), (name, float((err / np.maximum(amax, 1e-30)).max()))


def _ggml_lib():
    root = os.environ.get("MOQE_LLAMA_CPP")
    if not root:
        pytest.skip("MOQE_LLAMA_CPP (a llama.cpp build directory) is not set: ggml's own quantizers are not available")
    libs = sorted(Path(root).rglob("libggml-base.so*"))
    if not libs:
        pytest.skip(f"no libggml-base.so under {root}")
    lib = ctypes.CDLL(str(libs[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


@pytest.mark.parametrize("name", NAMES)
def test_quantizers_equal_ggml_byte_for_byte(name):
    lib = _ggml_lib()
    s = SPECS[name]
    w = weights((32, 1024), scale=1.0) * np.linspace(0.01, 3, 32, dtype=np.float32)[:, None]
    w[4, 300] = 50.0  # an outlier
    want = np.zeros(32 * 1024 // s.values * s.bytes, np.uint8)
    lib.ggml_quantize_init(s.type_id)
    assert lib.ggml_quantize_chunk(s.type_id, w.ctypes.data, want.ctypes.data, 0, 32, 1024, None) == want.size
    assert np.array_equal(get_format(name).quantize(w).arrays["blocks"].reshape(-1), want)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_bad_input(name):
    fmt = get_format(name)
    with pytest.raises(FormatError, match=f"inner dimension 80 .*{name}"):
        fmt.quantize(np.ones((4, 80), np.float32), name="layers.0.w")
    w = weights((2, SPECS[name].values))
    w[1, 3] = np.nan
    with pytest.raises(FormatError, match="NaN"):
        fmt.quantize(w)
    assert fmt.nbytes((4, 512)) == 4 * 512 // SPECS[name].values * SPECS[name].bytes
    qt = fmt.quantize(weights((2, 512)))
    qt.arrays["blocks"].reshape(-1, SPECS[name].bytes)[3, SPECS[name].halves[-1] + 1] = 0x7E  # an f16 NaN
    with pytest.raises(FormatError, match="NaN or inf"):
        qt.check_scales("layers.0.w")


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_numba_moe_gemm_equals_the_reference(monkeypatch, name, shape, lanes):
    """The GEMV (one row, several rows) and the tile decode of the prefill path, at 8 (AVX2) and 16 (AVX-512) lanes."""
    monkeypatch.setattr(cpu_moe_gemm, "LANES", lanes)
    T, E, A, N, K = shape
    w = get_format(name).quantize(weights((E, N, K)))
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    x = RNG.standard_normal((T, K)).astype(np.float32)
    sorted_ids, expert_ids, _ = get_op("moe_align", "numba")(ids, E, 16)
    got = get_op("moe_gemm", "numba")(x, w, sorted_ids, expert_ids, 16, A)
    want = get_op("moe_gemm", "numpy")(x, w, sorted_ids, expert_ids, 16, A)
    assert_close(got, want, atol=TOL * float(np.abs(want).max()) + 1e-6, rtol=0, what=f"{name} L={lanes}")


def test_every_ggml_type_is_a_registry_format():
    got = {f.name: f.ggml_type for f in FORMATS.values() if f.kind == "ggml"}
    assert got == {n: s.type_id for n, s in SPECS.items()}
