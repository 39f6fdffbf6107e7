"""Per-format row decoders for the fused quantized kernels (moe_gemm, qlinear): the "tiny decoder per
format" that one templated kernel is built around (see ``toolkit/cpu/moe_gemm.py``).

A format resolves once, when a kernel is set up, to a triple (``DECODERS[(kind, bits)](fmt)``):
  ``prepare(qt) -> w``: the tensor's arrays in the one layout every decoder reads (``WEIGHT_SLOTS``:
      a fixed tuple of typed arrays, each with the leading ``[E, N, ...]`` of the (stacked) weight; slots a
      format does not use hold a 1-element dummy), so that a single compiled kernel, cached on disk
      (``cache=True``), serves every format: f16 scales as ``uint16`` bits plus a 65536-entry f32 table;
      fp8 / f16 / bf16 codes with their decode table built from the format's own codec;
  ``code``: a small int naming the decoder; ``row_ops(code)`` binds it into the kernels' row operations as
      a global (per-format closures got a new cache key in every process; globals do not);
  ``perm(K) -> [K] | None``: the order decode writes a row in (below).
A decoder writes row ``n`` of expert ``e`` as f32 into ``out [K]``, in the order ``perm(K)`` gives
(``out[i] = W[e, n, perm[i]]``; ``perm`` is None for natural order). Packed affine codes decode plane by
plane (code ``c`` of every byte unit, then ``c + 1``) so that the stores are contiguous and vectorise; the
kernels permute the input rows the same way, once.
Shapes: ``E`` experts, ``N`` output rows, ``K`` inputs, ``G = K / g`` groups, ``B = K / 32`` blocks.

The kernels call ``decode_rows(w, e, n0, tile)`` (prefill tiles) and ``dot_rows(...)`` (GEMV: a block of
weight rows against a segment's input rows; packed affine rows fuse decode and dot per group,
``s * sum c x + z * sum x``), each bound to one format's decoder by ``row_ops(code)``: a kernel is compiled
per format, with only that format's decoder in it (one kernel with every decoder behind a run-time branch
took 19-26 s to compile cold; measured).
Code extraction truncates each code to int32 before the float conversion (``np.int32(b & 15)``): Numba
computes integer ops in int64 and LLVM then keeps 8 lanes per zmm; ``floor``-based float extraction did
not vectorise at all (measured).
Formats are looked up in ``DECODERS`` by ``(fmt.kind, fmt.bits)``; nothing here branches on names.
Numba's disk cache checks only the kernel's own file: after editing a decoder here, touch
``toolkit/cpu/moe_gemm.py`` (or clear its ``__pycache__``) so the cached kernels are rebuilt.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ..formats.base import Format, QTensor, readonly
from ._jit import twin

F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)  # [65536]

# The argument layout of every decoder: w[slot], slots in this order (name -> dtype; indices U8 .. LUT).
#   u8 / i8 / u16 / f32: codes or raw blocks [E, N, *]; scale f32 [E, N, 1] (one per row);
#   sb / zb: f16 bits of the per-group scale / offset [E, N, G]; lut f32 [L]: code or f16 -> value.
WEIGHT_SLOTS = {"u8": np.uint8, "i8": np.int8, "u16": np.uint16, "f32": np.float32, "scale": np.float32,
                "sb": np.uint16, "zb": np.uint16, "lut": np.float32}
U8, I8, U16, F32, SCALE, SB, ZB, LUT = range(len(WEIGHT_SLOTS))
_DUMMY = {name: np.zeros((1, 1, 1), dt) for name, dt in WEIGHT_SLOTS.items()}
_DUMMY["lut"] = np.zeros(1, np.float32)
F16_TO_F32 = readonly(F16_TO_F32)
# decoder codes (``ROW_DECODERS`` below)
DENSE_F32, DENSE_TABLE16, AFFINE4, AFFINE3, AFFINE2, CHANNEL_INT, CHANNEL_TABLE, Q8_0, Q4_0 = range(9)


def weights(**arrays) -> tuple:
    """The decoder argument tuple: ``arrays`` by slot name (dtypes as ``WEIGHT_SLOTS``), dummies elsewhere."""
    out = []
    for name, dt in WEIGHT_SLOTS.items():
        a = arrays.pop(name, _DUMMY[name])
        if a.dtype != dt:
            raise TypeError(f"decoder slot {name!r} needs {np.dtype(dt).name}, got {a.dtype.name}")
        out.append(readonly(np.ascontiguousarray(a)))
    if arrays:
        raise TypeError(f"unknown decoder slots {sorted(arrays)}")
    return tuple(out)


def _arr(qt: QTensor, name: str, k_len: int) -> np.ndarray:
    """Array ``name`` of qt as [E, N, k_len] (a 2-D weight gets E = 1)."""
    a = np.ascontiguousarray(qt.arrays[name])
    return a.reshape(-1, qt.shape[-2], k_len)


def _table(fmt: Format, name: str, n_codes: int, extra: dict) -> np.ndarray:
    """f32 [n_codes]: the value of every code, from the format's NumPy codec (scale 1)."""
    dt = fmt.arrays((1, 1))[name].dtype
    codes = np.arange(n_codes, dtype=np.uint32).astype(np.uint8 if n_codes == 256 else np.uint16).view(dt)
    arrays = {name: codes.reshape(1, n_codes), **{k: np.ones(1, v) for k, v in extra.items()}}
    return fmt.codec("numpy").dequantize(arrays, fmt, (1, n_codes)).reshape(-1).astype(np.float32)


# ---- dense: f32 (copy), f16 / bf16 (16-bit table) ------------------------------------------------------
@njit(cache=True, inline="always")
def _dec_f32(w, e, n, out):
    a = w[F32]
    for k in range(out.shape[0]):
        out[k] = a[e, n, k]


@njit(cache=True, inline="always")
def _dec_table16(w, e, n, out):
    a, lut = w[U16], w[LUT]
    for k in range(out.shape[0]):
        out[k] = lut[a[e, n, k]]


def _dense(fmt: Format):
    if fmt.bits == 32:
        return (lambda qt: weights(f32=_arr(qt, "weight", qt.shape[-1]).astype(np.float32, copy=False))), DENSE_F32, None
    lut = _table(fmt, "weight", 65536, {})
    return (lambda qt: weights(u16=_arr(qt, "weight", qt.shape[-1]).view(np.uint16), lut=lut)), DENSE_TABLE16, None


# ---- channel: int8 (convert) and fp8 (256-entry table), one f32 scale per row --------------------------
@njit(cache=True, inline="always")
def _dec_channel_int(w, e, n, out):
    q, s = w[I8], w[SCALE][e, n, 0]
    for k in range(out.shape[0]):
        out[k] = np.float32(q[e, n, k]) * s


@njit(cache=True, inline="always")
def _dec_channel_table(w, e, n, out):
    q, s, lut = w[U8], w[SCALE][e, n, 0], w[LUT]
    for k in range(out.shape[0]):
        out[k] = lut[q[e, n, k]] * s


def _channel(fmt: Format):
    names = list(fmt.arrays((1, 1)))  # [codes, scales]
    codes, scales = names
    if np.dtype(fmt.arrays((1, 1))[codes].dtype).kind == "i":
        return (lambda qt: weights(i8=_arr(qt, codes, qt.shape[-1]).view(np.int8),
                                   scale=_arr(qt, scales, 1).astype(np.float32, copy=False))), CHANNEL_INT, None
    lut = _table(fmt, codes, 256, {scales: np.float32})
    return (lambda qt: weights(u8=_arr(qt, codes, qt.shape[-1]).view(np.uint8),
                               scale=_arr(qt, scales, 1).astype(np.float32, copy=False), lut=lut)), CHANNEL_TABLE, None


# ---- affine int4 / int3 / int2: packed LSB-first codes, f16 scale and offset per group -------------------
# Rows decode in code-plane order: code c of byte unit u goes to plane c, out[c * U + u]. Every loop runs over
# one group's units through per-plane array views starting at 0 (LLVM vectorises those; stores at
# base + c * U into one view, or loops over range(lo, hi), it does not). Each code is truncated to int32
# before the float conversion: Numba computes integer ops in int64, and without the truncation LLVM keeps
# 8 int64 lanes per zmm register (vpmovzxbq / vcvtqq2ps) instead of 16 int32 ones (measured: 1.3-1.5x).
# ``_dot_*`` fuse decode and dot for one input row: sum_k (c_k s + z) x_k = s * sum_k c_k x_k + z * xsum_g,
# with the per-group input sums ``xsum`` computed once per call (``group_sums``).
@njit(cache=True, inline="always")
def _plane(a, c, U, lo, upg):  # units lo .. lo + upg of plane c of a plane-ordered row
    return a[c * U + lo : c * U + lo + upg]


@njit(cache=True, inline="always")
def _dec_int4(w, e, n, out):  # unit: 1 byte = 2 codes
    q, sb, zb, lut = w[U8], w[SB], w[ZB], w[LUT]
    U = out.shape[0] // 2
    upg = U // sb.shape[2]
    for gi in range(sb.shape[2]):
        s, z, lo = lut[sb[e, n, gi]], lut[zb[e, n, gi]], gi * upg
        qg, p0, p1 = q[e, n, lo : lo + upg], _plane(out, 0, U, lo, upg), _plane(out, 1, U, lo, upg)
        for j in range(upg):
            b = qg[j]
            p0[j] = np.float32(np.int32(b & 15)) * s + z
            p1[j] = np.float32(np.int32(b >> 4)) * s + z


@njit(cache=True, inline="always")
def _dot_int4(w, e, n, x, xsum):  # x [K] plane order, xsum [G] -> row . x
    q, sb, zb, lut = w[U8], w[SB], w[ZB], w[LUT]
    U = x.shape[0] // 2
    upg = U // sb.shape[2]
    tot = np.float32(0.0)
    for gi in range(sb.shape[2]):
        lo = gi * upg
        qg, x0, x1 = q[e, n, lo : lo + upg], _plane(x, 0, U, lo, upg), _plane(x, 1, U, lo, upg)
        a = np.float32(0.0)
        for j in range(upg):
            b = qg[j]
            a += np.float32(np.int32(b & 15)) * x0[j] + np.float32(np.int32(b >> 4)) * x1[j]
        tot += lut[sb[e, n, gi]] * a + lut[zb[e, n, gi]] * xsum[gi]
    return tot


@njit(cache=True, inline="always")
def _dec_int2(w, e, n, out):  # unit: 1 byte = 4 codes
    q, sb, zb, lut = w[U8], w[SB], w[ZB], w[LUT]
    U = out.shape[0] // 4
    upg = U // sb.shape[2]
    for gi in range(sb.shape[2]):
        s, z, lo = lut[sb[e, n, gi]], lut[zb[e, n, gi]], gi * upg
        qg, p0, p1 = q[e, n, lo : lo + upg], _plane(out, 0, U, lo, upg), _plane(out, 1, U, lo, upg)
        p2, p3 = _plane(out, 2, U, lo, upg), _plane(out, 3, U, lo, upg)
        for j in range(upg):
            b = qg[j]
            p0[j] = np.float32(np.int32(b & 3)) * s + z
            p1[j] = np.float32(np.int32((b >> 2) & 3)) * s + z
            p2[j] = np.float32(np.int32((b >> 4) & 3)) * s + z
            p3[j] = np.float32(np.int32(b >> 6)) * s + z


@njit(cache=True, inline="always")
def _dot_int2(w, e, n, x, xsum):
    q, sb, zb, lut = w[U8], w[SB], w[ZB], w[LUT]
    U = x.shape[0] // 4
    upg = U // sb.shape[2]
    tot = np.float32(0.0)
    for gi in range(sb.shape[2]):
        lo = gi * upg
        qg, x0, x1 = q[e, n, lo : lo + upg], _plane(x, 0, U, lo, upg), _plane(x, 1, U, lo, upg)
        x2, x3 = _plane(x, 2, U, lo, upg), _plane(x, 3, U, lo, upg)
        a = np.float32(0.0)
        for j in range(upg):
            b = qg[j]
            a += (np.float32(np.int32(b & 3)) * x0[j] + np.float32(np.int32((b >> 2) & 3)) * x1[j]
                  + np.float32(np.int32((b >> 4) & 3)) * x2[j] + np.float32(np.int32(b >> 6)) * x3[j])
        tot += lut[sb[e, n, gi]] * a + lut[zb[e, n, gi]] * xsum[gi]
    return tot


@njit(cache=True, inline="always")
def _u24(qg, j):  # unit j of a 3-byte-unit row: b0 | b1 << 8 | b2 << 16
    return np.int32(qg[3 * j]) | (np.int32(qg[3 * j + 1]) << 8) | (np.int32(qg[3 * j + 2]) << 16)


@njit(cache=True, inline="always")
def _dec_int3(w, e, n, out):  # unit: 3 bytes = 8 codes
    q, sb, zb, lut = w[U8], w[SB], w[ZB], w[LUT]
    U = out.shape[0] // 8
    upg = U // sb.shape[2]
    for gi in range(sb.shape[2]):
        s, z, lo = lut[sb[e, n, gi]], lut[zb[e, n, gi]], gi * upg
        qg = q[e, n, 3 * lo : 3 * (lo + upg)]
        p0, p1, p2, p3 = (_plane(out, 0, U, lo, upg), _plane(out, 1, U, lo, upg), _plane(out, 2, U, lo, upg),
                          _plane(out, 3, U, lo, upg))
        p4, p5, p6, p7 = (_plane(out, 4, U, lo, upg), _plane(out, 5, U, lo, upg), _plane(out, 6, U, lo, upg),
                          _plane(out, 7, U, lo, upg))
        for j in range(upg):
            v = _u24(qg, j)
            p0[j] = np.float32(np.int32(v & 7)) * s + z
            p1[j] = np.float32(np.int32((v >> 3) & 7)) * s + z
            p2[j] = np.float32(np.int32((v >> 6) & 7)) * s + z
            p3[j] = np.float32(np.int32((v >> 9) & 7)) * s + z
            p4[j] = np.float32(np.int32((v >> 12) & 7)) * s + z
            p5[j] = np.float32(np.int32((v >> 15) & 7)) * s + z
            p6[j] = np.float32(np.int32((v >> 18) & 7)) * s + z
            p7[j] = np.float32(np.int32(v >> 21)) * s + z


@njit(cache=True, inline="always")
def _dot_int3(w, e, n, x, xsum):
    q, sb, zb, lut = w[U8], w[SB], w[ZB], w[LUT]
    U = x.shape[0] // 8
    upg = U // sb.shape[2]
    tot = np.float32(0.0)
    for gi in range(sb.shape[2]):
        lo = gi * upg
        qg = q[e, n, 3 * lo : 3 * (lo + upg)]
        x0, x1, x2, x3 = (_plane(x, 0, U, lo, upg), _plane(x, 1, U, lo, upg), _plane(x, 2, U, lo, upg),
                          _plane(x, 3, U, lo, upg))
        x4, x5, x6, x7 = (_plane(x, 4, U, lo, upg), _plane(x, 5, U, lo, upg), _plane(x, 6, U, lo, upg),
                          _plane(x, 7, U, lo, upg))
        a = np.float32(0.0)
        for j in range(upg):
            v = _u24(qg, j)
            a += (np.float32(np.int32(v & 7)) * x0[j] + np.float32(np.int32((v >> 3) & 7)) * x1[j]
                  + np.float32(np.int32((v >> 6) & 7)) * x2[j] + np.float32(np.int32((v >> 9) & 7)) * x3[j]
                  + np.float32(np.int32((v >> 12) & 7)) * x4[j] + np.float32(np.int32((v >> 15) & 7)) * x5[j]
                  + np.float32(np.int32((v >> 18) & 7)) * x6[j] + np.float32(np.int32(v >> 21)) * x7[j])
        tot += lut[sb[e, n, gi]] * a + lut[zb[e, n, gi]] * xsum[gi]
    return tot


_AFFINE_BY_BITS = {4: (AFFINE4, 2), 3: (AFFINE3, 8), 2: (AFFINE2, 4)}  # bits -> (decoder code, codes per unit)


def _affine(fmt: Format):
    bits = fmt.bits
    code, unit_codes = _AFFINE_BY_BITS[bits]

    def perm(k):  # [K]: position in the row of each decoded value (plane c holds code c of every unit)
        return np.arange(k).reshape(k // unit_codes, unit_codes).T.reshape(-1)

    def prepare(qt):
        k = qt.shape[-1]
        n_groups = k // qt.fmt.group_size  # run-time: kernels are shared across group sizes
        return weights(u8=_arr(qt, "qweight", k * bits // 8), sb=_arr(qt, "scales", n_groups).view(np.uint16),
                       zb=_arr(qt, "biases", n_groups).view(np.uint16), lut=F16_TO_F32)

    return prepare, code, perm


# ---- GGML blocks of 32: q8_0 {f16 d; i8 qs[32]}, q4_0 {f16 d; u8 qs[16]} ------------------------------
@njit(cache=True, inline="always")
def _dec_q8_0(w, e, n, out):
    b, bs, lut = w[U8], w[I8], w[LUT]
    for blk in range(out.shape[0] // 32):
        o = blk * 34
        d = lut[np.uint16(b[e, n, o]) | (np.uint16(b[e, n, o + 1]) << np.uint16(8))]
        for i in range(32):
            out[blk * 32 + i] = np.float32(bs[e, n, o + 2 + i]) * d


@njit(cache=True, inline="always")
def _dec_q4_0(w, e, n, out):  # planar: low nibbles of every block in out[:K/2], high nibbles in out[K/2:]
    b, lut = w[U8], w[LUT]
    H = out.shape[0] // 2
    br, p0, p1 = b[e, n], out[:H], out[H:]
    for blk in range(out.shape[0] // 32):
        o = blk * 18
        d = lut[np.uint16(br[o]) | (np.uint16(br[o + 1]) << np.uint16(8))]
        for j in range(16):
            v = np.int32(br[o + 2 + j])
            p0[blk * 16 + j] = np.float32((v & np.int32(15)) - np.int32(8)) * d
            p1[blk * 16 + j] = np.float32((v >> np.int32(4)) - np.int32(8)) * d


def _q4_0_perm(k):  # plane 0: element j < 16 of every block, plane 1: element 16 + j
    idx = np.arange(k).reshape(k // 32, 2, 16)
    return np.concatenate([idx[:, 0].reshape(-1), idx[:, 1].reshape(-1)])


def _block(fmt: Format):
    if fmt.bits == 8:
        def prep8(qt):
            b = _arr(qt, "blocks", qt.shape[-1] // 32 * 34)
            return weights(u8=b, i8=b.view(np.int8), lut=F16_TO_F32)
        return prep8, Q8_0, None
    return (lambda qt: weights(u8=_arr(qt, "blocks", qt.shape[-1] // 32 * 18), lut=F16_TO_F32)), Q4_0, _q4_0_perm


# ---- the one dispatch point: decoder code -> (row decoder, fused row dot), inlined into each kernel --------
FUSED_MAX_ROWS = 3  # input rows up to which affine rows fuse decode and dot (more: decode once into buf; measured)


@njit(cache=True, inline="always")
def _no_dot(w, e, n, x, xsum):  # formats without a fused dot (never called: ``fusable`` is False)
    return np.float32(0.0)


@njit(cache=True, inline="always")
def _decode_body(dec, dot, fusable, w, e, n0, n1, xg, xsum, lo, hi, buf, res):
    for n in range(n0, n1):
        dec(w, e, n, res[n - n0])


@njit(cache=True, inline="always")
def _dot_body(dec, dot, fusable, w, e, n0, n1, xg, xsum, lo, hi, buf, res):
    if fusable and hi - lo <= FUSED_MAX_ROWS:
        for n in range(n0, n1):
            for m in range(lo, hi):
                res[m - lo, n - n0] = dot(w, e, n, xg[m], xsum[m])
    else:
        for n in range(n0, n1):
            dec(w, e, n, buf)
            for m in range(lo, hi):
                xm = xg[m]
                acc = np.float32(0.0)
                for k in range(buf.shape[0]):
                    acc += buf[k] * xm[k]
                res[m - lo, n - n0] = acc


# Templates of the two row operations; ``row_ops(code)`` binds DEC / DOT / FUSABLE to one format's decoder.
def _decode_rows(w, e, n0, tile):
    """tile [rows, K] <- rows n0 .. n0 + rows of expert e, each in perm order."""
    _decode_body(DEC, DOT, FUSABLE, w, e, n0, n0 + tile.shape[0], tile, tile, 0, 0, tile[0], tile)  # noqa: F821


def _dot_rows(w, e, n0, n1, xg, xsum, lo, hi, buf, res):
    """res [hi - lo, n1 - n0] <- rows n0..n1 of expert e . xg[m] for m in lo..hi (xg [R, K] in perm order;
    xsum [R, G] from ``group_sums``; buf [K] scratch). Affine rows against at most ``FUSED_MAX_ROWS``
    input rows fuse decode and dot; otherwise each row is decoded once into buf and dotted with every row."""
    _dot_body(DEC, DOT, FUSABLE, w, e, n0, n1, xg, xsum, lo, hi, buf, res)  # noqa: F821


# decoder code -> (name, row decoder, fused row dot, whether the fused dot exists)
ROW_DECODERS = {
    AFFINE4: ("affine4", _dec_int4, _dot_int4, True), AFFINE3: ("affine3", _dec_int3, _dot_int3, True),
    AFFINE2: ("affine2", _dec_int2, _dot_int2, True), Q4_0: ("q4_0", _dec_q4_0, _no_dot, False),
    Q8_0: ("q8_0", _dec_q8_0, _no_dot, False), CHANNEL_INT: ("channel_int", _dec_channel_int, _no_dot, False),
    CHANNEL_TABLE: ("channel_table", _dec_channel_table, _no_dot, False),
    DENSE_TABLE16: ("dense_table16", _dec_table16, _no_dot, False), DENSE_F32: ("dense_f32", _dec_f32, _no_dot, False),
}


@functools.cache
def row_ops(code: int) -> tuple:
    """(name, decode_rows, dot_rows) of one decoder: the templates above with the decoder bound as a global,
    so each kernel built on them compiles (and caches) only its own format's code."""
    name, dec, dot, fusable = ROW_DECODERS[code]
    bound = dict(DEC=dec, DOT=dot, FUSABLE=fusable)
    inline = njit(cache=True, inline="always")
    return name, inline(twin(_decode_rows, f"__{name}", **bound)), inline(twin(_dot_rows, f"__{name}", **bound))


def group_sums(w: tuple, x: np.ndarray) -> np.ndarray:
    """x [R, K] in natural order -> [R, G]: the sum of each quantization group (G = 1 without groups)."""
    G = w[SB].shape[2]
    return np.ascontiguousarray(x.reshape(x.shape[0], G, -1).sum(axis=2, dtype=np.float32))


# (kind, bits) -> factory(fmt) -> (prepare, code, perm). The only place a format is mapped to code.
DECODERS = {
    ("dense", 32): _dense, ("dense", 16): _dense,
    ("channel", 8): _channel,
    ("affine", 4): _affine, ("affine", 3): _affine, ("affine", 2): _affine,
    ("block", 8): _block, ("block", 4): _block,
}
