"""Per-format row codecs for the KV cache kernels: a traits table, looked up once by format.

Each entry gives Numba functions over one cache row (the head-dim vector of one token and head):
``store(x [hd] f32, out_row)`` (quantize on write), ``dot(row, q [hd]) -> f32`` (q . k, decoding block by
block) and ``axpy(row, p, acc [hd])`` (acc += p * v, decoding block by block). No row is ever decoded to
a temporary: the blocks are read inside the dot and axpy loops.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..formats import get_format
from ..formats.ggml import QK, q4_0_quantize_block, q8_0_quantize_block
from ..formats.scalar import f16_to_f32


# ---- f32 rows ------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def f32_store(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i]


@njit(cache=True, inline="always")
def f32_dot(row, q):
    s = np.float32(0.0)
    for i in range(q.shape[0]):
        s += q[i] * row[i]
    return s


@njit(cache=True, inline="always")
def f32_axpy(row, p, acc):
    for i in range(acc.shape[0]):
        acc[i] += p * row[i]


# ---- q8_0 rows: [hd/32 blocks x 34 bytes] -------------------------------------------------------------
@njit(cache=True, inline="always")
def q8_0_store(x, out):
    for b in range(x.shape[0] // QK):
        q8_0_quantize_block(x[b * QK : (b + 1) * QK], out[b * 34 : (b + 1) * 34])


@njit(cache=True, inline="always")
def q8_0_dot(row, q):
    s = np.float32(0.0)
    for b in range(q.shape[0] // QK):
        o = b * 34
        d = f16_to_f32(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8)))
        part = np.float32(0.0)
        for i in range(QK):
            v = np.int32(row[o + 2 + i])
            part += q[b * QK + i] * np.float32(v - 256 if v > 127 else v)
        s += d * part
    return s


@njit(cache=True, inline="always")
def q8_0_axpy(row, p, acc):
    for b in range(acc.shape[0] // QK):
        o = b * 34
        pd = p * f16_to_f32(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8)))
        for i in range(QK):
            v = np.int32(row[o + 2 + i])
            acc[b * QK + i] += pd * np.float32(v - 256 if v > 127 else v)


# ---- q4_0 rows: [hd/32 blocks x 18 bytes] -------------------------------------------------------------
@njit(cache=True, inline="always")
def q4_0_store(x, out):
    for b in range(x.shape[0] // QK):
        q4_0_quantize_block(x[b * QK : (b + 1) * QK], out[b * 18 : (b + 1) * 18])


@njit(cache=True, inline="always")
def q4_0_dot(row, q):
    s = np.float32(0.0)
    for b in range(q.shape[0] // QK):
        o = b * 18
        d = f16_to_f32(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8)))
        part = np.float32(0.0)
        for j in range(16):
            byte = np.int32(row[o + 2 + j])
            part += q[b * QK + j] * np.float32((byte & 15) - 8) + q[b * QK + j + 16] * np.float32((byte >> 4) - 8)
        s += d * part
    return s


@njit(cache=True, inline="always")
def q4_0_axpy(row, p, acc):
    for b in range(acc.shape[0] // QK):
        o = b * 18
        pd = p * f16_to_f32(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8)))
        for j in range(16):
            byte = np.int32(row[o + 2 + j])
            acc[b * QK + j] += pd * np.float32((byte & 15) - 8)
            acc[b * QK + j + 16] += pd * np.float32((byte >> 4) - 8)


# format name -> (store, dot, axpy): the one place that maps cache formats to their row codecs
ROW_CODECS = {
    "f32": (f32_store, f32_dot, f32_axpy),
    "q8_0": (q8_0_store, q8_0_dot, q8_0_axpy),
    "q4_0": (q4_0_store, q4_0_dot, q4_0_axpy),
}
CACHE_FORMATS = tuple(get_format(n) for n in ROW_CODECS)
