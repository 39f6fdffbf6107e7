"""Dense bit packing of small unsigned codes: a little-endian bit stream, LSB first.

Code ``i`` of a row occupies bits ``[i*b, (i+1)*b)`` of the row's byte string, so int4 puts element
``2j`` in the low nibble of byte ``j``, int2 puts four codes per byte, and int3 packs eight codes into
three bytes (``u24 = b0 | b1 << 8 | b2 << 16``; code ``k`` is ``(u24 >> 3k) & 7``). Rows are packed
independently: ``[..., K] uint8 -> [..., K*b/8] uint8`` (``K*b`` must be a multiple of 8).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..cpu._jit import Kernel
from ..errors import FormatError


def packed_len(k: int, bits: int) -> int:
    if (k * bits) % 8:
        raise FormatError(f"cannot pack {k} codes of {bits} bits into whole bytes")
    return k * bits // 8


# ---- NumPy reference -----------------------------------------------------------------------------------
def pack_ref(q: np.ndarray, bits: int) -> np.ndarray:
    k = q.shape[-1]
    n = packed_len(k, bits)
    shifts = np.arange(bits, dtype=np.uint8)
    stream = (q[..., None].astype(np.uint8) >> shifts) & np.uint8(1)  # [..., K, b]
    return np.packbits(stream.reshape(*q.shape[:-1], k * bits), axis=-1, bitorder="little").reshape(*q.shape[:-1], n)


def unpack_ref(p: np.ndarray, bits: int, k: int) -> np.ndarray:
    stream = np.unpackbits(p, axis=-1, bitorder="little")[..., : k * bits]
    stream = stream.reshape(*p.shape[:-1], k, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint16).astype(np.uint8)


# ---- Numba -------------------------------------------------------------------------------------------
def _pack_rows(q, bits, out):  # q [R, K] u8 -> out [R, K*b/8] u8
    for r in prange(q.shape[0]):
        acc = np.uint32(0)
        nacc = 0
        j = 0
        for k in range(q.shape[1]):
            acc |= np.uint32(q[r, k]) << np.uint32(nacc)
            nacc += bits
            while nacc >= 8:
                out[r, j] = np.uint8(acc & np.uint32(0xFF))
                acc >>= np.uint32(8)
                nacc -= 8
                j += 1


def _unpack_rows(p, bits, out):  # p [R, K*b/8] u8 -> out [R, K] u8
    mask = np.uint32((1 << bits) - 1)
    for r in prange(p.shape[0]):
        acc = np.uint32(0)
        nacc = 0
        j = 0
        for k in range(out.shape[1]):
            while nacc < bits:
                acc |= np.uint32(p[r, j]) << np.uint32(nacc)
                nacc += 8
                j += 1
            out[r, k] = np.uint8(acc & mask)
            acc >>= np.uint32(bits)
            nacc -= bits


_pack, _unpack = Kernel(_pack_rows), Kernel(_unpack_rows)  # serial below PARALLEL_MIN_WORK (toolkit/cpu/_jit.py):
# a small model's load compiles only the serial build (a parallel build costs about 1 s more to compile)


def pack_rows(q, bits, out):  # q [R, K] u8 -> out [R, K*b/8] u8
    _pack(q.size, q, bits, out)


def unpack_rows(p, bits, out):  # p [R, K*b/8] u8 -> out [R, K] u8
    _unpack(out.size, p, bits, out)


def pack_numba(q: np.ndarray, bits: int) -> np.ndarray:
    k = q.shape[-1]
    q2 = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1, k)
    out = np.empty((q2.shape[0], packed_len(k, bits)), np.uint8)
    _pack(q2.size, q2, bits, out)
    return out.reshape(*q.shape[:-1], -1)


def unpack_numba(p: np.ndarray, bits: int, k: int) -> np.ndarray:
    p2 = np.ascontiguousarray(p).reshape(-1, p.shape[-1])
    out = np.empty((p2.shape[0], k), np.uint8)
    _unpack(out.size, p2, bits, out)
    return out.reshape(*p.shape[:-1], k)
