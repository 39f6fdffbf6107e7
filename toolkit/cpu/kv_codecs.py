"""Per-format row codecs for the KV cache kernels: a traits table (``ROW_CODECS``), looked up once by format;
the kernels are compiled per format with its codecs bound in (``toolkit/cpu/_jit.twin``).

Each cache format has three Numba functions over one cache row (the head-dim vector of one token and KV head):
``store(x [hd] f32, out_row)`` (quantize on write), ``dot(row, q [rep, hd], out [rep])`` (the ``rep``
query heads sharing this KV head, q . k each) and ``axpy(row, p [rep], acc [rep, hd])`` (acc += p * v).
A quantized row is decoded (scales applied) into a ``[hd]`` scratch that lives in L1, used by all ``rep``
heads, then overwritten by the next row: the cache itself is never dequantized to a temporary.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..formats import get_format
from ..formats.ggml import QK, q4_0_quantize_block, q8_0_quantize_block


# ---- decoders shared by the kernels below ---------------------------------------------------------------
F16_LUT = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)  # half bits -> f32, exact


@njit(cache=True, inline="always")
def _scale(row, o, lut):
    return lut[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


# ---- f32 rows ------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def f32_store(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i]


@njit(cache=True, inline="always")
def f32_dot(row, q, out, wbuf, lut):  # q [rep, hd] -> out[r] = q[r] . row
    for r in range(q.shape[0]):
        s = np.float32(0.0)
        for i in range(q.shape[1]):
            s += q[r, i] * row[i]
        out[r] = s


@njit(cache=True, inline="always")
def f32_axpy(row, p, acc, wbuf, lut):  # acc [rep, hd] += p[r] * row
    for r in range(acc.shape[0]):
        pr = p[r]
        for i in range(acc.shape[1]):
            acc[r, i] += pr * row[i]


# ---- GGML rows: decode one row (hd values, scales applied) into a [hd] scratch, then reuse the f32 loops --
@njit(cache=True, inline="always")
def _q8_0_row(row, wbuf, lut):
    for b in range(wbuf.shape[0] // QK):
        o = b * 34
        d = _scale(row, o, lut)
        for i in range(QK):
            wbuf[b * QK + i] = d * np.float32(np.int8(row[o + 2 + i]))


@njit(cache=True, inline="always")
def _q4_0_row(row, wbuf, lut):
    for b in range(wbuf.shape[0] // QK):
        o = b * 18
        d = _scale(row, o, lut)
        for j in range(16):
            byte = np.int32(row[o + 2 + j])
            wbuf[b * QK + j] = d * np.float32((byte & 15) - 8)
            wbuf[b * QK + j + 16] = d * np.float32((byte >> 4) - 8)


# ---- the three row operations of each cache format (bound into the kernels per format: no run-time branch) --
@njit(cache=True, inline="always")
def q8_0_store(x, out):
    for b in range(x.shape[0] // QK):
        q8_0_quantize_block(x[b * QK : (b + 1) * QK], out[b * 34 : (b + 1) * 34])


@njit(cache=True, inline="always")
def q4_0_store(x, out):
    for b in range(x.shape[0] // QK):
        q4_0_quantize_block(x[b * QK : (b + 1) * QK], out[b * 18 : (b + 1) * 18])


@njit(cache=True, inline="always")
def q8_0_dot(row, q, out, wbuf, lut):  # wbuf: [hd] scratch
    _q8_0_row(row, wbuf, lut)
    f32_dot(wbuf, q, out, wbuf, lut)


@njit(cache=True, inline="always")
def q4_0_dot(row, q, out, wbuf, lut):
    _q4_0_row(row, wbuf, lut)
    f32_dot(wbuf, q, out, wbuf, lut)


@njit(cache=True, inline="always")
def q8_0_axpy(row, p, acc, wbuf, lut):
    _q8_0_row(row, wbuf, lut)
    f32_axpy(wbuf, p, acc, wbuf, lut)


@njit(cache=True, inline="always")
def q4_0_axpy(row, p, acc, wbuf, lut):
    _q4_0_row(row, wbuf, lut)
    f32_axpy(wbuf, p, acc, wbuf, lut)


# Cache format name -> (store, dot, axpy): the one table that maps cache formats to their row codecs.
ROW_CODECS = {"f32": (f32_store, f32_dot, f32_axpy), "q8_0": (q8_0_store, q8_0_dot, q8_0_axpy),
              "q4_0": (q4_0_store, q4_0_dot, q4_0_axpy)}
CACHE_FORMATS = tuple(get_format(n) for n in ROW_CODECS)
