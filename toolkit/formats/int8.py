"""int8: symmetric per-output-channel weights for W8A16 GEMMs.

Arrays: ``qweight`` int8 [..., N, K], ``scales`` f32 [..., N].
Quantize: ``s = absmax(row) / 127``; ``q = clip(rint(w / s), -127, 127)`` (0 where the row is all zero).
Dequantize: ``w = q * s``.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..cpu._jit import kernel
from .base import ArraySpec, Codec, Format


def layout(fmt: Format, shape: tuple) -> dict:
    return {"qweight": ArraySpec(np.dtype(np.int8), shape), "scales": ArraySpec(np.dtype(np.float32), shape[:-1])}


# ---- NumPy reference -----------------------------------------------------------------------------------
def quantize_ref(w: np.ndarray, fmt: Format) -> dict:
    s = (np.abs(w).max(axis=-1) / np.float32(127)).astype(np.float32)  # [..., N]
    safe = np.where(s == 0, np.float32(1), s)[..., None]
    q = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
    return {"qweight": q, "scales": s}


def dequantize_ref(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    return arrays["qweight"].astype(np.float32) * arrays["scales"][..., None]


# ---- Numba -------------------------------------------------------------------------------------------
@kernel()  # serial below PARALLEL_MIN_WORK (toolkit/cpu/_jit.py)
def _quantize_rows(w, q, s):  # w [R, K] f32 -> q [R, K] i8, s [R] f32
    for r in prange(w.shape[0]):
        amax = np.float32(0.0)
        for k in range(w.shape[1]):
            amax = max(amax, abs(w[r, k]))
        sc = amax / np.float32(127.0)
        s[r] = sc
        div = sc if sc != 0 else np.float32(1.0)
        for k in range(w.shape[1]):
            v = np.rint(w[r, k] / div)
            q[r, k] = np.int8(min(max(v, -127.0), 127.0))


@kernel()
def _dequantize_rows(q, s, out):
    for r in prange(q.shape[0]):
        for k in range(q.shape[1]):
            out[r, k] = np.float32(q[r, k]) * s[r]


def quantize_numba(w: np.ndarray, fmt: Format) -> dict:
    k = w.shape[-1]
    w2 = w.reshape(-1, k)
    q = np.empty(w2.shape, np.int8)
    s = np.empty(w2.shape[0], np.float32)
    _quantize_rows(w2.size, w2, q, s)
    return {"qweight": q.reshape(w.shape), "scales": s.reshape(w.shape[:-1])}


def dequantize_numba(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    q = arrays["qweight"].reshape(-1, shape[-1])
    out = np.empty(q.shape, np.float32)
    _dequantize_rows(out.size, q, np.ascontiguousarray(arrays["scales"]).reshape(-1), out)
    return out.reshape(shape)


INT8 = Format(name="int8", kind="channel", bits=8, group_size=None,
              doc="int8 symmetric, one f32 scale per output channel (W8A16)", layout=layout,
              codecs={"numpy": Codec(quantize_ref, dequantize_ref), "numba": Codec(quantize_numba, dequantize_numba)},
              cpu_decoder="channel_int", cuda_decoder="Int8Dec", uqff_tag=101, int_form="channel8")
FORMATS = (INT8,)
