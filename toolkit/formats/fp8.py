"""fp8: e4m3fn weights with one f32 scale per output channel, plus per-token activation quantization (W8A8).

Arrays: ``qweight`` uint8 [..., N, K] (e4m3fn codes), ``scales`` f32 [..., N].
Quantize a row (weights, or one token's activations): ``s = absmax / 448``; ``q = e4m3(x / s)`` with the
saturating encoder of :mod:`toolkit.formats.scalar` (bit-identical to ``ml_dtypes.float8_e4m3fn`` of the
value clipped to +-448). Dequantize: ``x = e4m3_decode(q) * s``. A W8A8 GEMM computes
``y[t, n] = a_s[t] * w_s[n] * sum_k dec(a_q[t, k]) * dec(w_q[n, k])``.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..cpu._jit import kernel
from .base import ArraySpec, Codec, Format
from .scalar import E4M3_TO_F32, FP8_MAX, e4m3_decode_ref, e4m3_encode, e4m3_encode_ref


def layout(fmt: Format, shape: tuple) -> dict:
    return {"qweight": ArraySpec(np.dtype(np.uint8), shape), "scales": ArraySpec(np.dtype(np.float32), shape[:-1])}


# ---- NumPy reference -----------------------------------------------------------------------------------
def quantize_ref(w: np.ndarray, fmt: Format | None = None) -> dict:
    s = (np.abs(w).max(axis=-1) / np.float32(FP8_MAX)).astype(np.float32)  # [..., N]
    safe = np.where(s == 0, np.float32(1), s)[..., None]
    return {"qweight": e4m3_encode_ref(w / safe), "scales": s}


def dequantize_ref(arrays, fmt: Format | None, shape: tuple) -> np.ndarray:
    return e4m3_decode_ref(arrays["qweight"]) * arrays["scales"][..., None]


# ---- Numba -------------------------------------------------------------------------------------------
@kernel()  # serial below PARALLEL_MIN_WORK (toolkit/cpu/_jit.py)
def _quantize_rows(x, q, s):  # x [R, K] f32 -> q [R, K] u8, s [R] f32
    for r in prange(x.shape[0]):
        amax = np.float32(0.0)
        for k in range(x.shape[1]):
            amax = max(amax, abs(x[r, k]))
        sc = amax / np.float32(FP8_MAX)
        s[r] = sc
        div = sc if sc != 0 else np.float32(1.0)
        for k in range(x.shape[1]):
            q[r, k] = e4m3_encode(x[r, k] / div)


@kernel()
def _dequantize_rows(q, s, lut, out):
    for r in prange(q.shape[0]):
        for k in range(q.shape[1]):
            out[r, k] = lut[q[r, k]] * s[r]


def quantize_numba(w: np.ndarray, fmt: Format | None = None) -> dict:
    k = w.shape[-1]
    x2 = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, k)
    q = np.empty(x2.shape, np.uint8)
    s = np.empty(x2.shape[0], np.float32)
    _quantize_rows(x2.size, x2, q, s)
    return {"qweight": q.reshape(w.shape), "scales": s.reshape(w.shape[:-1])}


def dequantize_numba(arrays, fmt: Format | None, shape: tuple) -> np.ndarray:
    q = arrays["qweight"].reshape(-1, shape[-1])
    out = np.empty(q.shape, np.float32)
    _dequantize_rows(out.size, q, np.ascontiguousarray(arrays["scales"]).reshape(-1), E4M3_TO_F32, out)
    return out.reshape(shape)


# Per-token activation quantization (W8A8): x [T, K] f32 -> (q uint8 [T, K], scales f32 [T]).
# The same row codec as the weights; named for the op it is in the MoE pipeline.
def fp8_act_quant_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = quantize_ref(np.asarray(x, np.float32))
    return d["qweight"], d["scales"]


def fp8_act_quant_numba(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = quantize_numba(x)
    return d["qweight"], d["scales"]


FP8 = Format(name="fp8", kind="channel", bits=8, group_size=None,
             doc="float8 e4m3fn weights, one f32 scale per output channel; activations quantized per token (W8A8)",
             layout=layout,
             codecs={"numpy": Codec(quantize_ref, dequantize_ref), "numba": Codec(quantize_numba, dequantize_numba)},
             act_quant={"numpy": fp8_act_quant_ref, "numba": fp8_act_quant_numba},
             cpu_decoder="channel_table", cuda_decoder="Fp8Dec", uqff_tag=102)
FORMATS = (FP8,)
