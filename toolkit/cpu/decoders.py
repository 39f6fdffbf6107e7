"""Per-format row decoders for the fused quantized kernels (moe_gemm, qlinear): the "tiny decoder per
format" that one templated kernel is built around (see ``toolkit/cpu/moe_gemm.py``).

A decoder is a triple built once per format (``DECODERS[(kind, bits)](fmt)``), when a kernel is set up:
  ``prepare(qt) -> w``: a tuple of the tensor's arrays as Numba can read them, every array with the
      leading ``[E, N, ...]`` of the (stacked) weight (f16 scales as ``uint16`` bits plus a 65536-entry
      f32 table; fp8 / f16 / bf16 codes with their decode table built from the format's own codec);
  ``perm(K) -> [K] | None``: the order decode writes a row in (below);
  ``decode(w, e, n, out)``: ``@njit`` writes row ``n`` of expert ``e`` as f32 into ``out [K]``, in the
      order ``perm(K)`` gives (``out[i] = W[e, n, perm[i]]``; ``perm`` is None for natural order). Packed
      affine codes decode plane by plane (code ``c`` of every byte unit, then ``c + 1``) so that the
      stores are contiguous and vectorise; the kernels permute the input rows the same way, once.
Shapes: ``E`` experts, ``N`` output rows, ``K`` inputs, ``G = K / g`` groups, ``B = K / 32`` blocks.

Code extraction casts the byte to int32 first (``np.int32(b) & 15``): on uint8 Numba widens to int64,
and here ``floor``-based float extraction did not vectorise at all (measured); int32 ops do (zmm).
Formats are looked up in ``DECODERS`` by ``(fmt.kind, fmt.bits)``; nothing here branches on names.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..formats.base import Format, QTensor

F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)  # [65536]


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
    a = w[0]
    for k in range(out.shape[0]):
        out[k] = a[e, n, k]


@njit(cache=True, inline="always")
def _dec_table16(w, e, n, out):
    a, lut = w[0], w[1]
    for k in range(out.shape[0]):
        out[k] = lut[a[e, n, k]]


def _dense(fmt: Format):
    if fmt.bits == 32:
        return (lambda qt: (_arr(qt, "weight", qt.shape[-1]).astype(np.float32, copy=False),)), _dec_f32, None
    lut = _table(fmt, "weight", 65536, {})
    return (lambda qt: (_arr(qt, "weight", qt.shape[-1]).view(np.uint16), lut)), _dec_table16, None


# ---- channel: int8 (convert) and fp8 (256-entry table), one f32 scale per row --------------------------
@njit(cache=True, inline="always")
def _dec_channel_int(w, e, n, out):
    q, s = w[0], w[1][e, n, 0]
    for k in range(out.shape[0]):
        out[k] = np.float32(q[e, n, k]) * s


@njit(cache=True, inline="always")
def _dec_channel_table(w, e, n, out):
    q, s, lut = w[0], w[1][e, n, 0], w[2]
    for k in range(out.shape[0]):
        out[k] = lut[q[e, n, k]] * s


def _channel(fmt: Format):
    names = list(fmt.arrays((1, 1)))  # [codes, scales]
    codes, scales = names
    if np.dtype(fmt.arrays((1, 1))[codes].dtype).kind == "i":
        return (lambda qt: (_arr(qt, codes, qt.shape[-1]), _arr(qt, scales, 1))), _dec_channel_int, None
    lut = _table(fmt, codes, 256, {scales: np.float32})
    return (lambda qt: (_arr(qt, codes, qt.shape[-1]), _arr(qt, scales, 1), lut)), _dec_channel_table, None


# ---- affine int4 / int3 / int2: packed LSB-first codes, f16 scale and offset per group -------------------
# Rows decode in code-plane order: code c of byte unit u goes to plane c, out[c * U + u]. Each plane is its
# own array view so that LLVM vectorises the unit loop (stores at base + c * U into one view do not).
@njit(cache=True, inline="always")
def _dec_int4(w, e, n, out):  # unit: 1 byte = 2 codes
    q, sb, zb, lut = w[0], w[1], w[2], w[3]
    U = out.shape[0] // 2
    upg = U // sb.shape[2]
    qr, p0, p1 = q[e, n], out[:U], out[U:]
    for gi in range(sb.shape[2]):
        s, z = lut[sb[e, n, gi]], lut[zb[e, n, gi]]
        for j in range(upg):  # a loop from 0 vectorises better than range(lo, hi)
            u = gi * upg + j
            b = np.int32(qr[u])
            p0[u] = np.float32(b & np.int32(15)) * s + z
            p1[u] = np.float32(b >> np.int32(4)) * s + z


@njit(cache=True, inline="always")
def _dec_int2(w, e, n, out):  # unit: 1 byte = 4 codes
    q, sb, zb, lut = w[0], w[1], w[2], w[3]
    U = out.shape[0] // 4
    upg = U // sb.shape[2]
    qr, p0, p1, p2, p3 = q[e, n], out[:U], out[U:2 * U], out[2 * U:3 * U], out[3 * U:]
    m = np.int32(3)
    for gi in range(sb.shape[2]):
        s, z = lut[sb[e, n, gi]], lut[zb[e, n, gi]]
        for j in range(upg):  # a loop from 0 vectorises better than range(lo, hi)
            u = gi * upg + j
            b = np.int32(qr[u])
            p0[u] = np.float32(b & m) * s + z
            p1[u] = np.float32((b >> np.int32(2)) & m) * s + z
            p2[u] = np.float32((b >> np.int32(4)) & m) * s + z
            p3[u] = np.float32(b >> np.int32(6)) * s + z


@njit(cache=True, inline="always")
def _dec_int3(w, e, n, out):  # unit: 3 bytes = 8 codes (u24 = b0 | b1 << 8 | b2 << 16)
    q, sb, zb, lut = w[0], w[1], w[2], w[3]
    U = out.shape[0] // 8
    upg = U // sb.shape[2]
    qr = q[e, n]
    p0, p1, p2, p3 = out[:U], out[U:2 * U], out[2 * U:3 * U], out[3 * U:4 * U]
    p4, p5, p6, p7 = out[4 * U:5 * U], out[5 * U:6 * U], out[6 * U:7 * U], out[7 * U:]
    m = np.int32(7)
    for gi in range(sb.shape[2]):
        s, z = lut[sb[e, n, gi]], lut[zb[e, n, gi]]
        for j in range(upg):  # a loop from 0 vectorises better than range(lo, hi)
            u = gi * upg + j
            v = np.int32(qr[3 * u]) | (np.int32(qr[3 * u + 1]) << np.int32(8)) | (np.int32(qr[3 * u + 2]) << np.int32(16))
            p0[u] = np.float32(v & m) * s + z
            p1[u] = np.float32((v >> np.int32(3)) & m) * s + z
            p2[u] = np.float32((v >> np.int32(6)) & m) * s + z
            p3[u] = np.float32((v >> np.int32(9)) & m) * s + z
            p4[u] = np.float32((v >> np.int32(12)) & m) * s + z
            p5[u] = np.float32((v >> np.int32(15)) & m) * s + z
            p6[u] = np.float32((v >> np.int32(18)) & m) * s + z
            p7[u] = np.float32(v >> np.int32(21)) * s + z


_AFFINE_BY_BITS = {4: (_dec_int4, 2), 3: (_dec_int3, 8), 2: (_dec_int2, 4)}  # bits -> (decoder, codes per unit)


def _affine(fmt: Format):
    bits = fmt.bits
    dec, unit_codes = _AFFINE_BY_BITS[bits]

    def perm(k):  # [K]: position in the row of each decoded value (plane c holds code c of every unit)
        return np.arange(k).reshape(k // unit_codes, unit_codes).T.reshape(-1)

    def prepare(qt):
        k = qt.shape[-1]
        n_groups = k // qt.fmt.group_size  # run-time: kernels are shared across group sizes
        return (_arr(qt, "qweight", k * bits // 8), _arr(qt, "scales", n_groups).view(np.uint16),
                _arr(qt, "biases", n_groups).view(np.uint16), F16_TO_F32)

    return prepare, dec, perm


# ---- GGML blocks of 32: q8_0 {f16 d; i8 qs[32]}, q4_0 {f16 d; u8 qs[16]} ------------------------------
@njit(cache=True, inline="always")
def _dec_q8_0(w, e, n, out):
    b, bs, lut = w[0], w[1], w[2]
    for blk in range(out.shape[0] // 32):
        o = blk * 34
        d = lut[np.uint16(b[e, n, o]) | (np.uint16(b[e, n, o + 1]) << np.uint16(8))]
        for i in range(32):
            out[blk * 32 + i] = np.float32(bs[e, n, o + 2 + i]) * d


@njit(cache=True, inline="always")
def _dec_q4_0(w, e, n, out):  # planar: low nibbles of every block in out[:K/2], high nibbles in out[K/2:]
    b, lut = w[0], w[1]
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
            return b, b.view(np.int8), F16_TO_F32
        return prep8, _dec_q8_0, None
    return (lambda qt: (_arr(qt, "blocks", qt.shape[-1] // 32 * 18), F16_TO_F32)), _dec_q4_0, _q4_0_perm


# (kind, bits) -> factory(fmt) -> (prepare, decode, perm). The only place a format is mapped to code.
DECODERS = {
    ("dense", 32): _dense, ("dense", 16): _dense,
    ("channel", 8): _channel,
    ("affine", 4): _affine, ("affine", 3): _affine, ("affine", 2): _affine,
    ("block", 8): _block, ("block", 4): _block,
}
