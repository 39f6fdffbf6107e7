"""Per-format decoders of the CPU GEMV and tile decode (``toolkit/cpu/gemv.py``): a CPU-private packed
layout per format, prepared once per weight, and the tiny step decoders each kernel is built around.

Shapes: ``E`` experts, ``N`` output rows, ``K`` inputs, ``G`` scale groups per row (1: one scale per row),
``B = K / 32`` GGML blocks; ``L`` SIMD lanes (8: AVX2 ymm, 16: AVX-512 zmm), ``P`` planes per step.

A **step** is what one decoder call turns into ``P`` f32 vectors of ``L`` lanes (``C = P * L`` codes) for
one weight row: lane ``l`` of plane ``p`` of step ``s`` is the code the kernel multiplies with
``x_perm[s * C + p * L + l]``. Packed codes keep their stored bit order: a lane holds one *unit* (a byte of
two int4 / four int2 codes, a 3-byte unit of eight int3 codes, or one 8-bit value) and plane ``p`` is code
``p`` of every unit, so ``perm`` maps ``s * C + p * L + l -> U * (s * L + l) + p`` (``U`` codes per unit;
identity for byte and dense formats). A step never straddles a group when ``g >= C``; when ``g < C`` (int2 /
int3 at g32 on 16 lanes) one step spans ``split = C / g`` groups and the kernel scales it lane by lane.

Decoders return *codes*: the kernel applies ``value = code * scale(group) + zero(group)`` as one vector FMA
per group and row, and the zero term as ``sum_g zero_g * X_g`` over the input's group sums ``X``.

| format | packed arrays (CPU-private; no larger than the stored ones except where noted) | code | scale, zero |
|---|---|---|---|
| int8 | ``q`` i8 [E, N, K], ``s`` f32 [E, N] (views) | q | s, - |
| fp8 | ``q`` u8 [E, N, K] e4m3, ``s`` f32 [E, N] (views) | e4m3 / 256 (bit cast) | 256 s, - |
| int4/int2/int3 | ``q`` u8 [E, N, K b / 8], ``s``/``z`` f16 bits [E, N, G] (views) | nibble / 2 bits / 3 bits | s, z |
| q4_0 | ``q`` u8 [E, N, K / 2] re-packed as int4 (LSB first), ``d`` f16 bits [E, N, B] | nibble - 8 | d, - |
| q8_0 | ``q`` i8 [E, N, K], ``d`` f16 bits [E, N, B] (split out of the blocks) | q | d, - |
| mxfp4 | ``q`` u8 [E, N, K / 2] re-packed as int4 (LSB first), ``e`` u8 e8m0 [E, N, B] | e2m1 * 2^-14 | 2^(e-113), - |
| f32/f16/bf16 | ``w`` [E, N, K] (view; f16 / bf16 as uint16 bits) | value | 1, - |
| q4_1 / q5_1 | ``q`` codes LSB first (int4; q5: 6-bit, 4 to a 3-byte unit), ``d``, ``m`` f16 bits [E, N, B] | code | d, m |
| q5_0 | ``q`` 6-bit units, ``d`` f16 bits [E, N, B] | code - 16 | d, - |
| q2_K..q6_K | ``q`` codes LSB first (2 / 3 / 4 bits; q5_K, q6_K 6-bit units), ``d`` f16 bits [E, N, K / 256], ``sc`` i8 [E, N, G]; with mins ``dmin``, ``m`` | code - off | d * sc[g], -dmin * m[g] |

GGML's q4_1 .. q6_K come from ``toolkit/formats/kquant.fields``; their copies are larger than the stored blocks
where codes are widened (q5 types 6 bits a code) or the 6-bit scale factors take a byte (q2_K 3.1 bits a weight
against 2.625, q4_K 4.6 against 4.5); q6_K's is the same size. The kernel computes ``d * sc[g]`` per group (as ggml
does), from the per-super-block ``d`` (``GPS`` groups each) and the per-group factor, so the values are ggml's.

The step functions below are templates: ``bind(dec, L, split)`` compiles a copy with the width-bound loads
(``toolkit/cpu/vec.py``) and constants bound as globals, so each (format, lanes, split) kernel carries only
its own decoder and caches on disk under its own name. Formats are looked up in ``DECODERS`` by
the record's ``cpu_decoder``; nothing here branches on names.
Numba's disk cache checks only the kernel's own file: after editing a decoder here, touch
``toolkit/cpu/gemv.py`` and ``toolkit/cpu/decode_layer.py`` (or clear their ``__pycache__``) so the cached kernels are
rebuilt.
"""
from __future__ import annotations

import functools
import weakref
from collections import abc
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

from ..formats.base import QTensor, readonly
from ._jit import twin
from .vec import band, e2m1, f32_bits, half, mul, ops, shr, sub, to_f32


# ---- step decoders (templates: L, C, SPLIT and the loads are bound per kernel) --------------------------
def _dec_bytes(w, e, n, s):  # int8 / q8_0: two L-value chunks, sign-extended
    q = w[0][e, n]
    return to_f32(LOAD(q, s * C)), to_f32(LOAD(q, s * C + L))  # noqa: F821


def _dec_e4m3(w, e, n, s):  # fp8: value / 256 by bit moves
    q = w[0][e, n]
    return LOAD_E4M3(q, s * C), LOAD_E4M3(q, s * C + L)  # noqa: F821


def _dec_f32(w, e, n, s):
    q = w[0][e, n]
    return LOAD(q, s * C), LOAD(q, s * C + L)  # noqa: F821


def _dec_f16(w, e, n, s):
    q = w[0][e, n]
    return LOAD_HALF(q, s * C), LOAD_HALF(q, s * C + L)  # noqa: F821


def _dec_bf16(w, e, n, s):
    q = w[0][e, n]
    return LOAD_BF16(q, s * C), LOAD_BF16(q, s * C + L)  # noqa: F821


def _dec_int4(w, e, n, s):  # L bytes -> low nibbles, high nibbles
    c = LOAD(w[0][e, n], s * L)  # noqa: F821
    return to_f32(band(c, 15)), to_f32(shr(c, 4))


def _dec_q4_0(w, e, n, s):  # L bytes -> low nibbles - 8, high nibbles - 8 (signed codes: no zero term)
    c = LOAD(w[0][e, n], s * L)  # noqa: F821
    eight = SPLAT(np.float32(8.0))  # noqa: F821
    return sub(to_f32(band(c, 15)), eight), sub(to_f32(shr(c, 4)), eight)


def _dec_mxfp4(w, e, n, s):  # L bytes -> low nibbles, high nibbles as e2m1 values * 2**-14
    c = LOAD(w[0][e, n], s * L)  # noqa: F821
    return e2m1(band(c, 15)), e2m1(shr(c, 4))


def _dec_int2(w, e, n, s):  # L bytes -> the four 2-bit codes of each
    c = LOAD(w[0][e, n], s * L)  # noqa: F821
    return (to_f32(band(c, 3)), to_f32(band(shr(c, 2), 3)), to_f32(band(shr(c, 4), 3)), to_f32(shr(c, 6)))


def _dec_int3(w, e, n, s):  # L 3-byte units -> the eight 3-bit codes of each
    c = LOAD_U24(w[0][e, n], s * 3 * L)  # noqa: F821
    return (to_f32(band(c, 7)), to_f32(band(shr(c, 3), 7)), to_f32(band(shr(c, 6), 7)), to_f32(band(shr(c, 9), 7)),
            to_f32(band(shr(c, 12), 7)), to_f32(band(shr(c, 15), 7)), to_f32(band(shr(c, 18), 7)), to_f32(shr(c, 21)))


def _dec_int3o(w, e, n, s):  # int3 codes minus OFF (q3_K: signed -4..3)
    c = LOAD_U24(w[0][e, n], s * 3 * L)  # noqa: F821
    o = SPLAT(np.float32(OFF))  # noqa: F821
    return (sub(to_f32(band(c, 7)), o), sub(to_f32(band(shr(c, 3), 7)), o), sub(to_f32(band(shr(c, 6), 7)), o),
            sub(to_f32(band(shr(c, 9), 7)), o), sub(to_f32(band(shr(c, 12), 7)), o), sub(to_f32(band(shr(c, 15), 7)), o),
            sub(to_f32(band(shr(c, 18), 7)), o), sub(to_f32(shr(c, 21)), o))


def _dec_u6(w, e, n, s):  # L 3-byte units -> the four 6-bit codes of each, minus OFF (q5 / q6 types)
    c = LOAD_U24(w[0][e, n], s * 3 * L)  # noqa: F821
    o = SPLAT(np.float32(OFF))  # noqa: F821
    return (sub(to_f32(band(c, 63)), o), sub(to_f32(band(shr(c, 6), 63)), o), sub(to_f32(band(shr(c, 12), 63)), o),
            sub(to_f32(shr(c, 18)), o))


# ---- one code at natural position k (row tails the steps do not cover), unscaled ---------------------
def _code_bytes(w, e, n, k):
    return np.float32(w[0][e, n, k])


def _code_e4m3(w, e, n, k):
    return half(((np.int32(np.int8(w[0][e, n, k])) << 7) & 0xBF80))


def _code_f32(w, e, n, k):
    return w[0][e, n, k]


def _code_f16(w, e, n, k):
    return half(w[0][e, n, k])


def _code_bf16(w, e, n, k):
    return f32_bits(np.uint32(w[0][e, n, k]) << np.uint32(16))


def _code_int4(w, e, n, k):
    return np.float32((np.int32(w[0][e, n, k >> 1]) >> ((k & 1) * 4)) & 15)


def _code_q4_0(w, e, n, k):
    return np.float32(((np.int32(w[0][e, n, k >> 1]) >> ((k & 1) * 4)) & 15) - 8)


def _code_mxfp4(w, e, n, k):  # e2m1 value * 2**-14 (the scale carries 2**14)
    c = (np.int32(w[0][e, n, k >> 1]) >> ((k & 1) * 4)) & 15
    return half(np.uint16(((c & 7) << 9) | ((c & 8) << 12)))


def _code_int2(w, e, n, k):
    return np.float32((np.int32(w[0][e, n, k >> 2]) >> ((k & 3) * 2)) & 3)


def _code_int3(w, e, n, k):
    q, u = w[0][e, n], 3 * (k >> 3)
    v = np.int32(q[u]) | (np.int32(q[u + 1]) << 8) | (np.int32(q[u + 2]) << 16)
    return np.float32((v >> ((k & 7) * 3)) & 7)


def _code_int3o(w, e, n, k):
    q, u = w[0][e, n], 3 * (k >> 3)
    v = np.int32(q[u]) | (np.int32(q[u + 1]) << 8) | (np.int32(q[u + 2]) << 16)
    return np.float32(((v >> ((k & 7) * 3)) & 7) - OFF)  # noqa: F821


def _code_u6(w, e, n, k):
    q, u = w[0][e, n], 3 * (k >> 2)
    v = np.int32(q[u]) | (np.int32(q[u + 1]) << 8) | (np.int32(q[u + 2]) << 16)
    return np.float32(((v >> ((k & 3) * 6)) & 63) - OFF)  # noqa: F821


# ---- scales and zero points per group ------------------------------------------------------------------
def _groups_one(w):
    return 1


def _groups_arr1(w):
    return w[1].shape[2]


def _scale_one(w, e, n, gi):
    return np.float32(1.0)


def _scale_row(w, e, n, gi):
    return w[1][e, n]


def _scale_row256(w, e, n, gi):  # fp8: the e4m3 -> half bias difference, 2**8
    return w[1][e, n] * np.float32(256.0)


def _scale_half(w, e, n, gi):
    return half(w[1][e, n, gi])


def _scale_e8m0(w, e, n, gi):  # mxfp4: 2**(e - 127), times 2**14 (the decoders' half-exponent bias)
    return f32_bits(np.uint32(min(np.int64(w[1][e, n, gi]) + 14, 254)) << np.uint32(23))  # exponent field e + 14


def _scales_rep(w, e, n, g0):  # split steps: the scales of groups g0 .. g0 + SPLIT, per lane
    return LOAD_HALF_REP(w[1][e, n], g0, SPLIT)  # noqa: F821


def _zero_none(w, e, n, gi):
    return np.float32(0.0)


def _zeros_none(w, e, n, g0):
    return ZERO_VEC()  # noqa: F821


def _zero_half(w, e, n, gi):  # affine: the f16 offset
    return half(w[2][e, n, gi])


def _zeros_half(w, e, n, g0):  # L groups' offsets
    return LOAD_HALF(w[2][e, n], g0)  # noqa: F821


def _zeros_half_rep(w, e, n, g0):
    return LOAD_HALF_REP(w[2][e, n], g0, SPLIT)  # noqa: F821


def _groups_arr2(w):  # k-quants: the per-group factors sc [E, N, G]
    return w[2].shape[2]


def _scale_k(w, e, n, gi):  # k-quants: d (f16, per super-block of GPS groups) * sc[g], exactly as ggml computes it
    return half(w[1][e, n, gi // GPS]) * np.float32(w[2][e, n, gi])  # noqa: F821


def _scales_rep_k(w, e, n, g0):  # the SPLIT groups g0.. of one step (one super-block), per lane
    return mul(SPLAT(half(w[1][e, n, g0 // GPS])), to_f32(LOAD_REP(w[2][e, n], g0, SPLIT)))  # noqa: F821


def _zero_k(w, e, n, gi):  # k-quants with mins: -(dmin * m[g])
    return -(half(w[3][e, n, gi // GPS]) * np.float32(w[4][e, n, gi]))  # noqa: F821


def _zeros_rep_k(w, e, n, g0):
    return mul(SPLAT(-half(w[3][e, n, g0 // GPS])), to_f32(LOAD_REP(w[4][e, n], g0, SPLIT)))  # noqa: F821


# ---- packing (NumPy, once per weight) --------------------------------------------------------------
def _lead(qt: QTensor, a: np.ndarray, k_len: int) -> np.ndarray:
    """a as [E, N, k_len] (a 2-D weight gets E = 1), read-only, C-contiguous."""
    return readonly(np.ascontiguousarray(a).reshape(-1, qt.shape[-2], k_len))


def _pack_channel(qt, code_dt):
    codes, scales = list(qt.fmt.arrays((1, 1)))  # [codes, scales] in the layout's order
    return (_lead(qt, qt.arrays[codes].view(code_dt), qt.shape[-1]),
            readonly(np.ascontiguousarray(qt.arrays[scales], np.float32).reshape(-1, qt.shape[-2])))


def _pack_affine(qt):
    k, g = qt.shape[-1], qt.fmt.group_size
    return (_lead(qt, qt.arrays["qweight"], k * qt.fmt.bits // 8), _lead(qt, qt.arrays["scales"].view(np.uint16), k // g),
            _lead(qt, qt.arrays["biases"].view(np.uint16), k // g))


def _nibble_blocks(qt, head: int) -> tuple:
    """GGML 4-bit blocks {head bytes of scale; u8 qs[16]} (element j < 16 the low nibble of byte j, j + 16 its
    high nibble) -> (codes re-packed LSB first [E, N, K / 2]: element 2i the low nibble of byte i; the blocks'
    head bytes [E*N, B, head])."""
    k = qt.shape[-1]
    blk = np.ascontiguousarray(qt.arrays["blocks"]).reshape(-1, k // 32, head + 16)  # [E*N, B, head + 16]
    packed = np.empty((blk.shape[0], k // 2), np.uint8)
    heads = np.empty((blk.shape[0], k // 32, head), np.uint8)
    _renibble(blk, head, packed, heads)
    return _lead(qt, packed, k // 2), heads


@njit(cache=True, boundscheck=False)
def _renibble(blk, head, packed, heads):  # blk [R, B, head + 16] -> packed [R, B * 16], heads [R, B, head]
    for r in range(blk.shape[0]):
        for b in range(blk.shape[1]):
            for h in range(head):
                heads[r, b, h] = blk[r, b, h]
            for i in range(8):  # elements 2i, 2i + 1: low nibbles of qs[2i], qs[2i + 1]
                lo, hi = blk[r, b, head + 2 * i], blk[r, b, head + 2 * i + 1]
                packed[r, 16 * b + i] = (lo & 15) | ((hi & 15) << 4)
                packed[r, 16 * b + 8 + i] = (lo >> 4) | (hi & 240)  # elements 16 + 2i, 17 + 2i: their high nibbles


def _pack_q4_0(qt):
    """blocks {f16 d; u8 qs[16]} -> int4 codes packed LSB first + d (f16 bits)."""
    codes, head = _nibble_blocks(qt, 2)
    return codes, _lead(qt, head.view(np.uint16)[..., 0], qt.shape[-1] // 32)


def _pack_mxfp4(qt):
    """blocks {u8 e; u8 qs[16]} -> e2m1 codes packed LSB first (as q4_0) + the e8m0 exponents."""
    codes, head = _nibble_blocks(qt, 1)
    return codes, _lead(qt, head[..., 0], qt.shape[-1] // 32)


def _unpack_nibbles(fmt, shape, packed, head: int) -> dict:
    """The inverse of :func:`_nibble_blocks` + its head: the stored GGML blocks, byte for byte."""
    (key, spec), = fmt.arrays(shape).items()
    codes, h = packed[0].reshape(-1, shape[-1] // 2), packed[1]
    heads = np.ascontiguousarray(h).view(np.uint8).reshape(codes.shape[0], shape[-1] // 32, head)
    blk = np.empty((codes.shape[0], shape[-1] // 32, head + 16), np.uint8)
    _unnibble(codes, heads, blk)
    return {key: blk.reshape(spec.shape).view(spec.dtype)}


@njit(cache=True, boundscheck=False)
def _unnibble(packed, heads, blk):  # packed [R, B * 16], heads [R, B, head] -> blk [R, B, head + 16]
    head = heads.shape[2]
    for r in range(blk.shape[0]):
        for b in range(blk.shape[1]):
            for h in range(head):
                blk[r, b, h] = heads[r, b, h]
            for i in range(8):
                lo, hi = packed[r, 16 * b + i], packed[r, 16 * b + 8 + i]  # elements 2i, 2i+1 / 16+2i, 17+2i
                blk[r, b, head + 2 * i] = (lo & 15) | ((hi & 15) << 4)
                blk[r, b, head + 2 * i + 1] = (lo >> 4) | (hi & 240)


def _unpack_q4_0(fmt, shape, packed) -> dict:
    return _unpack_nibbles(fmt, shape, packed, 2)


def _unpack_mxfp4(fmt, shape, packed) -> dict:
    return _unpack_nibbles(fmt, shape, packed, 1)


def _unpack_q8_0(fmt, shape, packed) -> dict:
    (key, spec), = fmt.arrays(shape).items()
    k = shape[-1]
    q, d = packed[0].reshape(-1, k), np.ascontiguousarray(packed[1]).reshape(-1, k // 32)
    blk = np.empty((q.shape[0], k // 32, 34), np.uint8)
    blk[..., :2] = d.view(np.uint8).reshape(q.shape[0], k // 32, 2)
    blk[..., 2:] = q.view(np.uint8).reshape(q.shape[0], k // 32, 32)
    return {key: blk.reshape(spec.shape).view(spec.dtype)}


def _pack_q8_0(qt):
    k = qt.shape[-1]
    blk = np.ascontiguousarray(qt.arrays["blocks"]).reshape(-1, k // 32, 34)
    q, d = np.empty((blk.shape[0], k), np.int8), np.empty((blk.shape[0], k // 32), np.uint16)
    _split_q8_0(blk, blk.view(np.int8), q, d)
    return _lead(qt, q, k), _lead(qt, d, k // 32)


@njit(cache=True, boundscheck=False)
def _split_q8_0(blk, signed, q, d):  # blk [R, B, 34] (and as int8) -> q [R, B * 32] i8, d [R, B] f16 bits (LE)
    for r in range(blk.shape[0]):
        for b in range(blk.shape[1]):
            d[r, b] = np.uint16(blk[r, b, 0]) | (np.uint16(blk[r, b, 1]) << 8)
            for j in range(32):
                q[r, 32 * b + j] = signed[r, b, 2 + j]


def _pack_ggml(qt):
    """GGML q4_1 / q5_* / k-quant blocks -> (codes packed LSB first [E, N, K * b / 8] with b = 2, 3, 4 or 6 (5-bit
    codes take 6), d f16 bits [E, N, K / values], then per format: m f16 bits [E, N, B] (q4_1 / q5_1); sc i8
    [E, N, G] (k-quants), then dmin f16 bits [E, N, K / 256] and m i8 [E, N, G] (k-quants with mins))."""
    from ..formats.kquant import SPECS, fields
    from ..formats.packing import pack_rows

    spec, K = SPECS[qt.fmt.name], qt.shape[-1]
    f = fields(qt.fmt.name, qt.arrays["blocks"])
    codes = np.ascontiguousarray(f.codes.reshape(-1, K))  # [E*N, K] value order
    b = {2: 2, 3: 3, 4: 4, 5: 6, 6: 6}[spec.code_bits]
    q = np.empty((codes.shape[0], K * b // 8), np.uint8)
    pack_rows(codes, b, q)
    out = [_lead(qt, q, K * b // 8), _lead(qt, f.d, K // spec.values)]
    if f.sc is not None:
        out.append(_lead(qt, f.sc, K // spec.group))
    if f.dmin is not None:
        out.append(_lead(qt, f.dmin, K // spec.values))
    if f.m is not None:
        out.append(_lead(qt, f.m, K // spec.group))
    return tuple(out)


def _pack_dense(qt):
    a = qt.arrays["weight"]
    return (_lead(qt, a if a.dtype == np.float32 else a.view(np.uint16), qt.shape[-1]),)


# ---- the table ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decoder:
    """One format's CPU decoder: its packing and the templates bound into the kernels."""

    name: str  # kernel-name stem
    unit: int  # codes per lane unit (1: one value per lane)
    planes: int  # P: f32 vectors per step
    has_zero: bool  # a zero point per group (the kernel adds sum_g z_g X_g)
    pack: Callable  # QTensor -> tuple of arrays (the layout above)
    group: Callable  # QTensor -> codes per scale group (K when one scale per row)
    funcs: tuple  # (dec, code_at, groups, scale_at, scales_rep, zero_at, zeros, zeros_rep) templates
    consts: tuple = ()  # (name, value) constants the templates read (OFF, GPS)
    zero_vec: bool = True  # ``zeros`` loads L groups' zero points as one vector (else summed one group at a time)
    unpack: Callable | None = None  # (fmt, shape, packed) -> the stored arrays, exactly (None: not invertible here)
    # the one-token GEMV reads its 4 rows one after another, each as one sequential stream (gemv.py ``_dot1``), at
    # the lane widths of ``gemv.ROW_BY_ROW_LANES`` (AVX2): a 16-bit weight's step is a plain load, and 4 interleaved
    # row streams held its GEMV at 15 GB/s on one AVX2 core (probe 21); on AVX-512 the interleaved streams are the
    # faster. Not for f32: the compiled decode step runs a dense f32 weight on gemv_f32, whose bits the 4-row
    # template gives
    row_by_row: bool = False

    def steps(self, L: int, g: int) -> tuple[int, int]:
        """(C, split): codes per step and groups per step (1 when a group holds whole steps)."""
        C = self.planes * L
        return C, (C // g if g < C else 1)

    def perm(self, K: int, L: int) -> np.ndarray | None:
        """[K] x index of each position the kernel reads (None: natural order)."""
        if self.unit == 1:
            return None
        C, P, U = self.planes * L, self.planes, self.unit
        main = K // C * C
        s, p, lane = np.meshgrid(np.arange(main // C), np.arange(P), np.arange(L), indexing="ij")  # [S, P, L]
        return np.concatenate([(U * (s * L + lane) + p).reshape(-1), np.arange(main, K)])


_AFFINE = (_groups_arr1, _scale_half, _scales_rep, _zero_half, _zeros_half, _zeros_half_rep)
_PLAIN = (_groups_one, _scale_one, _scales_rep, _zero_none, _zeros_none, _zeros_none)
_row_group = lambda qt: qt.shape[-1]  # noqa: E731
_fmt_group = lambda qt: qt.fmt.group_size  # noqa: E731


def _channel_int(fmt):  # int8 codes, one f32 scale per row
    return Decoder("int8", 1, 2, False, lambda qt: _pack_channel(qt, np.int8), _row_group,
                   (_dec_bytes, _code_bytes, _groups_one, _scale_row, _scales_rep, _zero_none, _zeros_none, _zeros_none))


def _channel_table(fmt):  # fp8 (e4m3) codes decoded through a table, one scale per row
    return Decoder("fp8", 1, 2, False, lambda qt: _pack_channel(qt, np.uint8), _row_group,
                   (_dec_e4m3, _code_e4m3, _groups_one, _scale_row256, _scales_rep, _zero_none, _zeros_none, _zeros_none))


def _affine(fmt):
    dec, code = {4: (_dec_int4, _code_int4), 3: (_dec_int3, _code_int3), 2: (_dec_int2, _code_int2)}[fmt.bits]
    unit = {4: 2, 3: 8, 2: 4}[fmt.bits]
    return Decoder(f"affine{fmt.bits}", unit, unit, True, _pack_affine, _fmt_group, (dec, code) + _AFFINE)


def _block(fmt):
    if fmt.bits == 8:
        return Decoder("q8_0", 1, 2, False, _pack_q8_0, _fmt_group,
                       (_dec_bytes, _code_bytes, _groups_arr1, _scale_half, _scales_rep, _zero_none, _zeros_none,
                        _zeros_none), unpack=_unpack_q8_0)
    return Decoder("q4_0", 2, 2, False, _pack_q4_0, _fmt_group,
                   (_dec_q4_0, _code_q4_0, _groups_arr1, _scale_half, _scales_rep, _zero_none, _zeros_none,
                    _zeros_none), unpack=_unpack_q4_0)


def _mx(fmt):
    return Decoder("mxfp4", 2, 2, False, _pack_mxfp4, _fmt_group,
                   (_dec_mxfp4, _code_mxfp4, _groups_arr1, _scale_e8m0, _scales_rep, _zero_none, _zeros_none,
                    _zeros_none), unpack=_unpack_mxfp4)


_KQ = (_groups_arr2, _scale_k, _scales_rep_k, _zero_none, _zeros_none, _zeros_none)
_KQ_MIN = (_groups_arr2, _scale_k, _scales_rep_k, _zero_k, _zeros_none, _zeros_rep_k)
_BLOCK_NONE = (_groups_arr1, _scale_half, _scales_rep, _zero_none, _zeros_none, _zeros_none)
# code bits -> (unit, step decoder, one-code decoder): 5- and 6-bit codes are stored as 6 (4 to a 3-byte unit)
_CODES = {2: (4, _dec_int2, _code_int2), 3: (8, _dec_int3o, _code_int3o), 4: (2, _dec_int4, _code_int4),
          5: (4, _dec_u6, _code_u6), 6: (4, _dec_u6, _code_u6)}


def _spec_group(qt):
    from ..formats.kquant import SPECS

    return SPECS[qt.fmt.name].group


def _ggml(fmt):
    """GGML q4_1 / q5_0 / q5_1 and the k-quants: codes (minus ``off``) * scale (+ zero)."""
    from ..formats.kquant import SPECS

    spec = SPECS[fmt.name]
    unit, dec, code = _CODES[spec.code_bits]
    if spec.values == 32:  # blocks of 32: the scale is d (f16), the zero m (f16): q4_1 / q5_1 are affine
        rest, zero_vec = (_AFFINE, True) if spec.min else (_BLOCK_NONE, True)
    else:
        rest, zero_vec = (_KQ_MIN, False) if spec.min else (_KQ, False)
    assert spec.off == 0 or dec in (_dec_int3o, _dec_u6), fmt.name  # the other step decoders subtract nothing
    return Decoder(fmt.name, unit, unit, bool(spec.min), _pack_ggml, _spec_group, (dec, code) + rest,
                   consts=(("OFF", spec.off), ("GPS", spec.values // spec.group)), zero_vec=zero_vec)


def _dense(fmt):
    if fmt.bits == 32:
        dec, code = _dec_f32, _code_f32
    else:
        is_bf16 = np.dtype(fmt.arrays((1, 1))["weight"].dtype).name == "bfloat16"  # the stored dtype decides
        dec, code = (_dec_bf16, _code_bf16) if is_bf16 else (_dec_f16, _code_f16)
    name = {_dec_f32: "f32", _dec_bf16: "bf16", _dec_f16: "f16"}[dec]
    return Decoder(name, 1, 2, False, _pack_dense, _row_group, (dec, code) + _PLAIN, row_by_row=fmt.bits == 16)


# the record's ``cpu_decoder`` -> factory(fmt) -> Decoder. The only place a format is mapped to code.
DECODERS = {
    "dense_f32": _dense, "dense_table16": _dense,
    "channel_int": _channel_int, "channel_table": _channel_table,
    "affine4": _affine, "affine3": _affine, "affine2": _affine,
    "q8_0": _block, "q4_0": _block,
    "mxfp4": _mx,
    **{n: _ggml for n in ("q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")},
}


def decoder_for(fmt) -> Decoder | None:
    """The format's CPU decoder, or None when it has none."""
    factory = DECODERS.get(fmt.cpu_decoder)
    return factory(fmt) if factory is not None else None

_NAMES = ("dec", "code_at", "groups", "scale_at", "scales_rep", "zero_at", "zeros", "zeros_rep")


@functools.cache
def bind(dec: Decoder, L: int, split: int) -> dict:
    """The decoder's templates compiled for L lanes and ``split`` groups per step, as inlinable functions."""
    o = ops(L)
    consts = dict(L=L, C=dec.planes * L, SPLIT=split, LOAD=o["load"], LOAD_HALF=o["load_half"],
                  LOAD_E4M3=o["load_e4m3"], LOAD_BF16=o["load_bf16"], LOAD_U24=o["load_u24"],
                  LOAD_HALF_REP=o["load_half_rep"], LOAD_REP=o["load_rep"], SPLAT=o["splat"], ZERO_VEC=o["zero"],
                  **dict(dec.consts))
    inline = njit(cache=True, inline="always")
    return {k: inline(twin(f, f"__{dec.name}_L{L}_s{split}", **consts)) for k, f in zip(_NAMES, dec.funcs)}


# ---- packed weights, prepared once per QTensor -----------------------------------------------------
_PACKED: dict[int, tuple] = {}  # id(qt) -> (ids of qt's arrays, {key: packed arrays})


def packed(qt: QTensor, dec: Decoder, key=None, pack=None) -> tuple:
    """``dec.pack(qt)`` expert by expert (:func:`pack_experts`), or ``pack(qt)``, computed on the first call
    for this tensor and kept until it is garbage-collected; re-packed if its arrays were replaced."""
    a = qt.arrays
    ids = tuple(id(v) for v in a.values()) if isinstance(a, dict) else (id(a),)  # a derived mapping: itself
    entry = _PACKED.get(id(qt))
    if entry is None or entry[0] != ids:
        if entry is None:
            weakref.finalize(qt, _PACKED.pop, id(qt), None)
        entry = _PACKED[id(qt)] = (ids, {})
    k = key or dec.name
    if k not in entry[1]:
        entry[1][k] = pack(qt) if pack is not None else pack_experts(dec, qt)
    return entry[1][k]


class PackedArrays(abc.Mapping):
    """A quantized tensor's stored arrays rebuilt, exactly, from its CPU packed layout when read (an export, a
    dequantize) and not kept: a weight quantized at load holds its packed layout only, instead of both."""

    def __init__(self, unpack: Callable, fmt, shape: tuple, packed):
        self.unpack, self.fmt, self.shape, self.packed = unpack, fmt, tuple(shape), packed
        self._keys = tuple(fmt.arrays(self.shape))

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._keys:
            raise KeyError(key)
        return self.unpack(self.fmt, self.shape, self.packed)[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in self.fmt.arrays(self.shape).values())


def keep_packed_only(qt: QTensor, key: str, unpack: Callable | None) -> bool:
    """After packing: drop ``qt``'s stored arrays when they are this process's own memory (quantized here, or
    joined from copies), its packing ``key`` copied them and ``unpack(fmt, shape, packing)`` rebuilds them
    exactly; the QTensor then reads them back from the packed layout (:class:`PackedArrays`). Mapped stored
    pages are released by the packing itself. Returns whether the stored arrays were dropped."""
    from ..mapped import file_backed, file_ranges

    entry = _PACKED.get(id(qt))
    if unpack is None or entry is None or key not in entry[1] or not isinstance(qt.arrays, dict):
        return False
    packed, stored = entry[1][key], qt.stored()
    arrays = packed.arrays if hasattr(packed, "arrays") else packed  # a Prepared or Packed, or a packing's tuple
    ranges = file_ranges()
    if any(file_backed(a, ranges) for a in stored) or any(np.may_share_memory(o, a) for o in arrays for a in stored):
        return False
    qt.arrays = PackedArrays(unpack, qt.fmt, qt.shape, packed)
    _PACKED[id(qt)] = ((id(qt.arrays),), entry[1])
    return True


def held_arrays(qt: QTensor) -> list:
    """The arrays held for ``qt`` on the CPU: its packed layouts where any were made, and its stored arrays
    unless a packing replaced them (mapped pages, handed back); else its stored arrays."""
    from ..mapped import file_backed, file_ranges

    entry = _PACKED.get(id(qt))
    if entry is None or not entry[1]:
        return qt.stored()
    ranges = file_ranges()
    out = [a for a in qt.stored() if not file_backed(a, ranges)]  # stored arrays the packing did not replace
    for v in entry[1].values():
        out.extend(v.arrays if hasattr(v, "arrays") else v)  # a Prepared, or a packing's tuple (the same arrays)
    return list({id(a): a for a in out}.values())


PIECE_ROWS = 1024  # rows packed at a time (a 4096-wide q8_0 piece: 4.3 MB)


def pack_experts(dec: Decoder, qt: QTensor) -> tuple:
    """``dec.pack(qt)``, piece by piece (``QTensor.pieces``: at most ``PIECE_ROWS`` rows of one expert) into the
    whole packed arrays when the packing copies, so the transient is one piece's, not the weight's; each piece's
    stored pages are released once packed when they are a read-only file mapping (``toolkit.mapped``): the
    packed layout replaces the mapped one in memory instead of adding to it. A packing that is a view of the
    stored arrays (int8, int4, 16-bit) is taken whole, and nothing is released (the kernels read those pages)."""
    from ..mapped import file_ranges, release

    pieces, ranges = qt.pieces(PIECE_ROWS), file_ranges()
    e, r0, sub = next(pieces)
    first = dec.pack(sub)  # each [1, rows, ...]
    if any(np.may_share_memory(o, a) for o in first for a in sub.stored()):
        return dec.pack(qt)
    E, N = (qt.shape[0] if len(qt.shape) == 3 else 1), qt.shape[-2]
    full = tuple(np.empty((E, N) + o.shape[2:], o.dtype) for o in first)
    part = first
    while True:
        for f, o in zip(full, part):
            f[e, r0:r0 + o.shape[1]] = o[0]
        release(sub.stored(), ranges)
        nxt = next(pieces, None)
        if nxt is None:
            return tuple(readonly(f) for f in full)
        e, r0, sub = nxt
        part = dec.pack(sub)
