"""Scalar codecs shared by the format kernels: float16 and float8 e4m3 bit conversions.

Numba on the CPU has no float16 arrays, so half-precision scales travel as ``uint16`` bit patterns and
are converted here, exactly (round to nearest even, subnormals, overflow to inf, NaN kept).
The e4m3 encoder is *saturating*: it equals ``ml_dtypes.float8_e4m3fn`` applied to the value clipped
to [-448, 448] (ml_dtypes itself maps values beyond 464 and inf to NaN); NaN stays NaN (0x7f/0xff).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from numba import njit

FP8_MAX = 448.0
E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # [256] decode table


# ---- NumPy reference (the spec) ---------------------------------------------------------------------
def f16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> uint16 bit patterns of IEEE half (round to nearest even)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def f16_value(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def e4m3_encode_ref(x: np.ndarray) -> np.ndarray:
    """f32 -> uint8 e4m3fn codes, saturating at +-448, NaN preserved."""
    x = np.asarray(x, dtype=np.float32)
    clipped = np.where(np.isnan(x), x, np.clip(x, -FP8_MAX, FP8_MAX)).astype(np.float32)
    return clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_decode_ref(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# ---- Numba scalar versions (bit-identical to the reference) -----------------------------------------
@njit(cache=True, inline="always")
def f16_to_f32(h):
    """uint16 half bits -> float32 value (exact)."""
    h = np.int64(h)
    sign = -1.0 if (h >> 15) & 1 else 1.0
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = math.ldexp(float(m), -24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(1024 + m), e - 25)
    return np.float32(sign * v)


@njit(cache=True, inline="always")
def f32_to_f16(x):
    """float32 value -> uint16 half bits, round to nearest even (as numpy's astype(float16))."""
    xf = float(x)
    s = 0
    if xf < 0.0 or (xf == 0.0 and math.copysign(1.0, xf) < 0.0):
        s = 0x8000
    a = abs(xf)
    if a != a:
        return np.uint16(s | 0x7E00)
    if a >= 65520.0:  # rounds to inf
        return np.uint16(s | 0x7C00)
    if a < 6.103515625e-05:  # below the smallest normal half: subnormal, quantum 2**-24
        q = np.int64(np.rint(a * 16777216.0))
        return np.uint16(s | q)
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    q = np.int64(np.rint((m * 2.0 - 1.0) * 1024.0))
    ex = e - 1
    if q == 1024:
        q = 0
        ex += 1
    return np.uint16(s | ((ex + 15) << 10) | q)


@njit(cache=True, inline="always")
def e4m3_encode(x):
    """float32 -> uint8 e4m3fn code, saturating at +-448 (bit-identical to e4m3_encode_ref)."""
    xf = float(x)
    s = 0
    if xf < 0.0 or (xf == 0.0 and math.copysign(1.0, xf) < 0.0):
        s = 0x80
    a = abs(xf)
    if a != a:
        return np.uint8(s | 0x7F)
    if a > FP8_MAX:
        a = FP8_MAX
    if a < 0.015625:  # below the smallest normal (2**-6): subnormal, quantum 2**-9
        q = np.int64(np.rint(a * 512.0))  # q == 8 is exactly the smallest normal's code
        return np.uint8(s | q)
    m, e = math.frexp(a)
    q = np.int64(np.rint((m * 2.0 - 1.0) * 8.0))
    ex = e - 1
    if q == 8:
        q = 0
        ex += 1
    return np.uint8(s | ((ex + 7) << 3) | q)


@njit(cache=True)
def e4m3_encode_array(x, out):
    """x f32 [n] -> out uint8 [n] (for tests of the scalar encoder)."""
    for i in range(x.shape[0]):
        out[i] = e4m3_encode(x[i])


@njit(cache=True)
def f16_encode_array(x, out):
    for i in range(x.shape[0]):
        out[i] = f32_to_f16(x[i])


@njit(cache=True)
def f16_decode_array(h, out):
    for i in range(h.shape[0]):
        out[i] = f16_to_f32(h[i])
