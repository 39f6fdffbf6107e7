"""GGML's other block types: q4_1, q5_0, q5_1 (blocks of 32) and the k-quants q2_K..q6_K (super-blocks of 256),
byte-identical to ggml (``gguf.quants.dequantize`` is the oracle of every decoder; ``gguf.quants.quantize`` of the
q4_1 / q5_0 / q5_1 quantizers; llama.cpp's ``quantize_row_q*_K_ref`` of the k-quant ones, ported below).

Every type is one shape of data: a stored **code** per value, a **scale** per group and optionally a **min**::

    value = scale[g] * (code - off) - min[g]              k-quants:  scale = d * sc[g], min = dmin * m[g]
    value = d * (code - off) + m                          q4_1 / q5_0 / q5_1 (one group = one block of 32)

| type | block bytes | values | code bits | group | off | min | stored bits / weight |
|---|---|---|---|---|---|---|---|
| q4_1 | 20 {f16 d, f16 m, u8 qs[16]} | 32 | 4 | 32 | 0 | + m (f16) | 5.0 |
| q5_0 | 22 {f16 d, u32 qh, u8 qs[16]} | 32 | 5 | 32 | 16 | - | 5.5 |
| q5_1 | 24 {f16 d, f16 m, u32 qh, u8 qs[16]} | 32 | 5 | 32 | 0 | + m (f16) | 6.0 |
| q2_K | 84 {u8 scales[16], u8 qs[64], f16 d, f16 dmin} | 256 | 2 | 16 | 0 | - dmin * m (4-bit sc, m) | 2.625 |
| q3_K | 110 {u8 hmask[32], u8 qs[64], u8 scales[12], f16 d} | 256 | 3 | 16 | 4 | - (6-bit signed sc) | 3.4375 |
| q4_K | 144 {f16 d, f16 dmin, u8 scales[12], u8 qs[128]} | 256 | 4 | 32 | 0 | - dmin * m (6-bit sc, m) | 4.5 |
| q5_K | 176 {f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]} | 256 | 5 | 32 | 0 | - dmin * m | 5.5 |
| q6_K | 210 {u8 ql[128], u8 qh[64], i8 scales[16], f16 d} | 256 | 6 | 16 | 32 | - (8-bit signed sc) | 6.5625 |

Element order inside a block (GGML's ``dequantize_row_*``): q4_1 / q5_*: element ``j < 16`` the low nibble of
``qs[j]``, ``j + 16`` its high nibble, bit 4 from bit ``j`` of ``qh``. q2_K / q3_K: each half of 128 values is four
runs of 32, run ``r`` taking bits ``2r`` of ``qs[32 h + l]`` (q3_K: bit 2 = bit ``4h + r`` of ``hmask[l]``, set
meaning "no -4"). q4_K / q5_K: four chunks of 64, the first 32 the low nibbles of ``qs[32 c + l]``, the next 32 the
high nibbles (q5_K: bit 4 = bit ``2c`` / ``2c + 1`` of ``qh[l]``). q6_K: per half, ``ql[l]`` low/high nibbles are
values ``l`` / ``l + 64``, ``ql[l + 32]`` values ``l + 32`` / ``l + 96``; ``qh[l]`` bits 0-1, 2-3, 4-5, 6-7 their bit 4-5.

:func:`fields` turns a block array into (codes in value order, d, sc, dmin, m): the dequantizer, the CPU packing
(``toolkit/cpu/decoders.py``) and the tests all start from it. Array: ``blocks`` uint8 [..., N, K / values * bytes].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..cpu._jit import Kernel
from .base import ArraySpec, Codec, Format, array_module
from .scalar import f16_to_f32, f32_to_f16

QK_K = 256


@dataclass(frozen=True)
class Ggml:
    """One GGML type's shape of data (the table of the module docstring)."""

    type_id: int
    values: int  # per block
    bytes: int  # per block
    code_bits: int
    group: int  # values per scale
    off: int  # subtracted from the code
    min: str  # "" (none), "k" (value -= dmin * m[g]) or "half" (value += m, one f16 per block)
    halves: tuple  # byte offsets of the block's f16 fields (d, then dmin or m)


SPECS = {"q4_1": Ggml(3, 32, 20, 4, 32, 0, "half", (0, 2)), "q5_0": Ggml(6, 32, 22, 5, 32, 16, "", (0,)),
         "q5_1": Ggml(7, 32, 24, 5, 32, 0, "half", (0, 2)), "q2_k": Ggml(10, QK_K, 84, 2, 16, 0, "k", (80, 82)),
         "q3_k": Ggml(11, QK_K, 110, 3, 16, 4, "", (108,)), "q4_k": Ggml(12, QK_K, 144, 4, 32, 0, "k", (0, 2)),
         "q5_k": Ggml(13, QK_K, 176, 5, 32, 0, "k", (0, 2)), "q6_k": Ggml(14, QK_K, 210, 6, 16, 32, "", (208,))}


@dataclass
class Fields:
    """A block array taken apart (leading dims flattened to ``nb`` blocks; ``G = values / group``)."""

    codes: np.ndarray  # u8 [nb, values], value order, 0 .. 2**code_bits - 1
    d: np.ndarray  # u16 [nb] f16 bits of the block's d
    sc: np.ndarray | None  # i8 [nb, G] per-group scale factors (k-quants; None: the scale is d)
    dmin: np.ndarray | None  # u16 [nb] f16 bits: dmin (k-quants with mins) or m (q4_1 / q5_1); None: no min
    m: np.ndarray | None  # i8 [nb, G] per-group min factors (k-quants with mins)


def _h(b: np.ndarray, at: int) -> np.ndarray:
    return array_module(b).ascontiguousarray(b[:, at:at + 2]).view(np.uint16)[:, 0]


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_K / q5_K's 12 scale bytes [nb, 12] -> 6-bit (sc, m) [nb, 8] (ggml's ``get_scale_min_k4``)."""
    xp, (lo, mid, hi) = array_module(s), (s[:, 0:4], s[:, 4:8], s[:, 8:12])
    sc = xp.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    m = xp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.int8), m.astype(np.int8)


def _runs4(q: np.ndarray, shifts) -> np.ndarray:
    """[nb, halves, 32] bytes -> [nb, halves * len(shifts) * 32] codes (the run r of a half = bits at shifts[r])."""
    return array_module(q).stack([(q >> np.uint8(s)) for s in shifts], axis=2).reshape(q.shape[0], -1)


def fields(name: str, blocks: np.ndarray) -> Fields:
    """Take a ``name`` block array (any leading shape, last dim a whole number of blocks) apart: NumPy arrays from
    NumPy blocks, CuPy arrays from CuPy blocks (the same statement of the layout on a GPU)."""
    spec, xp = SPECS[name], array_module(blocks)
    b = xp.ascontiguousarray(blocks, np.uint8).reshape(-1, spec.bytes)  # [nb, bytes]
    nb = b.shape[0]
    if spec.values == 32:
        qs = b[:, -16:]
        codes = xp.concatenate([qs & 15, qs >> 4], axis=1)  # [nb, 32]
        if spec.code_bits == 5:
            qh = xp.ascontiguousarray(b[:, -20:-16]).view("<u4")  # [nb, 1]
            codes = codes | (((qh >> xp.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        return Fields(codes, _h(b, 0), None, _h(b, 2) if spec.min else None, None)
    if name == "q2_k":
        s = b[:, 0:16]
        codes = _runs4(b[:, 16:80].reshape(nb, 2, 32), (0, 2, 4, 6)) & 3
        return Fields(codes, _h(b, 80), (s & 15).astype(np.int8), _h(b, 82), (s >> 4).astype(np.int8))
    if name == "q3_k":
        low = _runs4(b[:, 32:96].reshape(nb, 2, 32), (0, 2, 4, 6)) & 3  # [nb, 256]
        high = xp.stack([(b[:, 0:32] >> np.uint8(i)) & 1 for i in range(8)], axis=1).reshape(nb, 256)
        s = b[:, 96:108]
        lo = xp.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)  # [nb, 16]
        hi = xp.concatenate([(s[:, 8:12] >> np.uint8(2 * i)) & 3 for i in range(4)], axis=1)
        sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
        return Fields(low | (high << 2), _h(b, 108), sc, None, None)
    if name in ("q4_k", "q5_k"):
        sc, m = _scale_min_k4(b[:, 4:16])
        qs = b[:, -128:].reshape(nb, 4, 32)
        codes = xp.stack([qs & 15, qs >> 4], axis=2).reshape(nb, 256)  # chunk c: low nibbles, then high
        if name == "q5_k":
            qh = b[:, 16:48]  # [nb, 32]
            hb = xp.stack([(qh >> np.uint8(i)) & 1 for i in range(8)], axis=1)  # [nb, 8 (chunk, nibble), 32]
            codes = codes | (hb.reshape(nb, 256) << 4)
        return Fields(codes, _h(b, 0), sc, _h(b, 2), m)
    # q6_k
    ql, qh = b[:, 0:128].reshape(nb, 2, 2, 32), b[:, 128:192].reshape(nb, 2, 32)
    low = xp.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)  # [nb, 2, 4, 32]
    high = xp.stack([(qh >> np.uint8(2 * i)) & 3 for i in range(4)], axis=2)
    return Fields((low | (high << 4)).reshape(nb, 256), _h(b, 208), b[:, 192:208].view(np.int8), None, None)


def q4_k_blocks(f: Fields) -> np.ndarray:
    """The inverse of ``fields("q4_k", ...)``: its five fields (6-bit ``sc`` / ``m``) -> blocks u8 [nb, 144], byte
    for byte (the 12 scale bytes as ``get_scale_min_k4`` reads them). The integer kernels keep q4_K taken apart
    (``toolkit/cpu/igemm_pack.py``) and rebuild the stored blocks with it when an export reads them."""
    nb = f.codes.shape[0]
    out = np.empty((nb, 144), np.uint8)
    out[:, 0:2] = np.ascontiguousarray(f.d, np.uint16).view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = np.ascontiguousarray(f.dmin, np.uint16).view(np.uint8).reshape(nb, 2)
    sc, m = f.sc.view(np.uint8), f.m.view(np.uint8)  # [nb, 8], each < 64
    out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    c = f.codes.reshape(nb, 4, 2, 32)  # chunk, (low, high) nibble, value
    out[:, 16:] = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(nb, 128)
    return out


# ---- NumPy reference: dequantize ------------------------------------------------------------------------------
def dequantize_raw(name: str, blocks: np.ndarray) -> np.ndarray:
    """A ``name`` block array -> f32 values [nb * values] (the spec; equals ``gguf.quants.dequantize``)."""
    spec, f = SPECS[name], fields(name, blocks)
    nb, G = f.codes.shape[0], spec.values // spec.group
    d = f.d.view(np.float16).astype(np.float32)[:, None]  # [nb, 1]
    q = (f.codes.astype(np.int16) - spec.off).astype(np.float32).reshape(nb, G, spec.group)
    if f.sc is None:  # blocks of 32: d * q (+ m)
        out = d[:, :, None] * q
        if spec.min:
            out = out + f.dmin.view(np.float16).astype(np.float32)[:, None, None]
    else:
        out = (d * f.sc.astype(np.float32))[:, :, None] * q
        if spec.min:
            out = out - (f.dmin.view(np.float16).astype(np.float32)[:, None] * f.m.astype(np.float32))[:, :, None]
    return out.reshape(-1)


def _layout(fmt: Format, shape: tuple) -> dict:
    values, nbytes = fmt.block
    return {"blocks": ArraySpec(np.dtype(np.uint8), shape[:-1] + (shape[-1] // values * nbytes,))}


def _dequantize(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    return dequantize_raw(fmt.name, arrays["blocks"]).reshape(shape)


# ---- quantize: q4_1 / q5_0 / q5_1 by the gguf package (its NumPy port of ggml's reference) -----------------------
def _quantize_gguf(w: np.ndarray, fmt: Format) -> dict:
    from gguf import GGMLQuantizationType, quants

    out = quants.quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType(fmt.ggml_type))
    return {"blocks": np.ascontiguousarray(out, np.uint8).reshape(*w.shape[:-1], -1)}


# ---- quantize: the k-quants, llama.cpp's quantize_row_q{2..6}_K_ref line by line (f32 arithmetic throughout) ----
F = np.float32
_MAGIC = F(12582912.0)  # 1.5 * 2**23: adding it rounds to the nearest integer (ties to even), as ggml's nearest_int
_EPS = F(1e-15)  # GROUP_MAX_EPS


@njit(cache=True, inline="always")
def _nearest(v):
    return np.int64((F(v) + _MAGIC) - _MAGIC)


@njit(cache=True, inline="always")
def _put_f16(out, at, v):
    h = f32_to_f16(v)
    out[at] = np.uint8(h & 0xFF)
    out[at + 1] = np.uint8(h >> 8)


@njit(cache=True)
def _qkx2(x, w, L, Laux, nmax, rmin, rdelta, nstep, use_mad):
    """ggml's make_qkx2_quants: codes L (0..nmax) and (scale, min) minimising the weighted error."""
    n = x.shape[0]
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F(0)
    if mx == mn:
        L[:] = 0
        return F(0), -mn
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    best = F(0)
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest(iscale * (x[i] - mn))))
        diff = scale * F(L[i]) + mn - x[i]
        best += w[i] * (abs(diff) if use_mad else diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F(step) + F(nmax)) / (mx - mn)
        sum_l, sum_l2, sum_xl = F(0), F(0), F(0)
        for i in range(n):
            lv = max(0, min(nmax, _nearest(iscale * (x[i] - mn))))
            Laux[i] = lv
            fl = F(lv)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            cur = F(0)
            for i in range(n):
                diff = this_scale * F(Laux[i]) + this_min - x[i]
                cur += w[i] * (abs(diff) if use_mad else diff * diff)
            if cur < best:
                L[:] = Laux
                best, scale, mn = cur, this_scale, this_min
    return scale, -mn


@njit(cache=True)
def _amax_signed(x):
    mx, amax = F(0), F(0)
    for i in range(x.shape[0]):
        if abs(x[i]) > amax:
            amax, mx = abs(x[i]), x[i]
    return mx, amax


@njit(cache=True, inline="always")
def _weighted_fit(x, iscale, nmax, L, off):
    """Codes round(iscale x) clamped to [-nmax, nmax - 1], plus ``off``, into L; returns the x^2-weighted
    (sum w x l, sum w l^2) of the unshifted codes (ggml's loops, in their f32 order)."""
    sumlx, suml2 = F(0), F(0)
    for i in range(x.shape[0]):
        lv = max(-nmax, min(nmax - 1, _nearest(iscale * x[i])))
        L[i] = lv + off
        w = x[i] * x[i]
        sumlx += w * x[i] * F(lv)
        suml2 += w * F(lv) * F(lv)
    return sumlx, suml2


@njit(cache=True)
def _q3_quants(x, L, nmax):
    """ggml's make_q3_quants with do_rmse: codes L (0 .. 2 nmax - 1) and the scale."""
    n = x.shape[0]
    mx, amax = _amax_signed(x)
    if amax < _EPS:
        L[:] = 0
        return F(0)
    sumlx, suml2 = _weighted_fit(x, F(-nmax) / mx, nmax, L, 0)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * F(L[i])
            if slx > 0:
                sl2 = suml2 - w * F(L[i]) * F(L[i])
                new = max(-nmax, min(nmax - 1, _nearest(x[i] * sl2 / slx)))
                if new != L[i]:
                    slx += w * x[i] * F(new)
                    sl2 += w * F(new) * F(new)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i], sumlx, suml2 = new, slx, sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else F(0)


@njit(cache=True)
def _qx_quants(x, L, nmax):
    """ggml's make_qx_quants with rmse_type 1 and no importance weights: codes L (0 .. 2 nmax - 1), the scale."""
    n = x.shape[0]
    mx, amax = _amax_signed(x)
    if amax < _EPS:
        L[:] = 0
        return F(0)
    sumlx, suml2 = _weighted_fit(x, F(-nmax) / mx, nmax, L, nmax)
    scale = sumlx / suml2 if suml2 != 0 else F(0)
    best = scale * sumlx
    Laux = np.empty(n, np.int64)
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = _weighted_fit(x, -(F(nmax) + F(0.1) * F(step)) / mx, nmax, Laux, nmax)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L[:] = Laux
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def _pack_runs(L, qs):  # L [256] 2-bit codes -> qs [64]: per half, byte l holds runs 0..3 of value l (q2_K, q3_K)
    for j in range(0, QK_K, 128):
        for i in range(32):
            qs[j // 4 + i] = np.uint8(L[j + i] | (L[j + i + 32] << 2) | (L[j + i + 64] << 4) | (L[j + i + 96] << 6))


@njit(cache=True)
def _q2_k_block(x, y):  # x [256] f32 -> y [84] u8
    L = np.zeros(QK_K, np.int64)
    Laux = np.zeros(16, np.int64)
    w = np.empty(16, np.float32)
    scales, mins = np.empty(16, np.float32), np.empty(16, np.float32)
    max_scale, max_min = F(0), F(0)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        for i in range(16):
            w[i] = abs(xs[i])
        scales[j], mins[j] = _qkx2(xs, w, L[16 * j:16 * j + 16], Laux, 3, F(-0.5), F(0.1), 15, True)
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    y[:] = 0
    if max_scale > 0:
        iscale = F(15) / max_scale
        for j in range(16):
            y[j] = np.uint8(_nearest(iscale * scales[j]))
        _put_f16(y, 80, max_scale / F(15))
    if max_min > 0:
        iscale = F(15) / max_min
        for j in range(16):
            y[j] |= np.uint8(_nearest(iscale * mins[j]) << 4)
        _put_f16(y, 82, max_min / F(15))
    dd, dm = f16_to_f32(np.uint16(y[80]) | (np.uint16(y[81]) << 8)), f16_to_f32(np.uint16(y[82]) | (np.uint16(y[83]) << 8))
    for j in range(16):
        d = dd * F(y[j] & 15)
        if d == 0:
            continue
        m = dm * F(y[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, _nearest((x[16 * j + i] + m) / d)))
    _pack_runs(L, y[16:80])


@njit(cache=True)
def _q3_k_block(x, y):  # x [256] f32 -> y [110] u8
    L = np.zeros(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    max_scale, amax = F(0), F(0)
    for j in range(16):
        scales[j] = _q3_quants(x[16 * j:16 * j + 16], L[16 * j:16 * j + 16], 4)
        if abs(scales[j]) > amax:
            amax, max_scale = abs(scales[j]), scales[j]
    y[:] = 0
    if max_scale != 0:
        iscale = F(-32) / max_scale
        for j in range(16):
            lv = max(-32, min(31, _nearest(iscale * scales[j]))) + 32
            if j < 8:
                y[96 + j] = np.uint8(lv & 15)
            else:
                y[96 + j - 8] |= np.uint8((lv & 15) << 4)
            y[96 + 8 + j % 4] |= np.uint8((lv >> 4) << (2 * (j // 4)))
        _put_f16(y, 108, F(1) / iscale)
    dd = f16_to_f32(np.uint16(y[108]) | (np.uint16(y[109]) << 8))
    for j in range(16):
        s = np.int64(y[96 + j]) & 15 if j < 8 else np.int64(y[96 + j - 8]) >> 4
        sc = (s | (((np.int64(y[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        d = dd * F(sc)
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, _nearest(x[16 * j + i] / d))) + 4
    m, hm = 0, 1
    for j in range(QK_K):
        if L[j] > 3:
            y[m] |= np.uint8(hm)
            L[j] -= 4
        m += 1
        if m == 32:
            m, hm = 0, hm << 1
    _pack_runs(L, y[32:96])


@njit(cache=True)
def _qk_scales(y, scales, mins, max_scale, max_min):  # q4_K / q5_K: 6-bit sc / m into y[4:16], d and dmin
    inv_s = F(63) / max_scale if max_scale > 0 else F(0)
    inv_m = F(63) / max_min if max_min > 0 else F(0)
    for j in range(8):
        ls = min(63, _nearest(inv_s * scales[j]) & 255)
        lm = min(63, _nearest(inv_m * mins[j]) & 255)
        if j < 4:
            y[4 + j] = np.uint8(ls)
            y[4 + j + 4] = np.uint8(lm)
        else:
            y[4 + j + 4] = np.uint8((ls & 15) | ((lm & 15) << 4))
            y[4 + j - 4] |= np.uint8((ls >> 4) << 6)
            y[4 + j] |= np.uint8((lm >> 4) << 6)
    _put_f16(y, 0, max_scale / F(63))
    _put_f16(y, 2, max_min / F(63))


@njit(cache=True, inline="always")
def _scale_min(s, j):  # get_scale_min_k4 over the 12 scale bytes s
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


@njit(cache=True)
def _qk_block(x, y, nmax, rmin, nstep, L):  # q4_K / q5_K common part: codes into L [256] (0..nmax), scales into y
    Laux = np.zeros(32, np.int64)
    w = np.empty(32, np.float32)
    scales, mins = np.empty(8, np.float32), np.empty(8, np.float32)
    max_scale, max_min = F(0), F(0)
    y[:] = 0
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sum_x2 = F(0)
        for i in range(32):
            sum_x2 += xs[i] * xs[i]
        av = np.sqrt(sum_x2 / F(32))
        for i in range(32):
            w[i] = av + abs(xs[i])
        scales[j], mins[j] = _qkx2(xs, w, L[32 * j:32 * j + 32], Laux, nmax, rmin, F(0.1), nstep, False)
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    _qk_scales(y, scales, mins, max_scale, max_min)
    dd, dm = f16_to_f32(np.uint16(y[0]) | (np.uint16(y[1]) << 8)), f16_to_f32(np.uint16(y[2]) | (np.uint16(y[3]) << 8))
    for j in range(8):
        sc, m = _scale_min(y[4:16], j)
        d = dd * F(sc)
        if d == 0:
            continue
        dmv = dm * F(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nearest((x[32 * j + i] + dmv) / d)))


@njit(cache=True)
def _q4_k_block(x, y):  # x [256] f32 -> y [144] u8
    L = np.zeros(QK_K, np.int64)
    _qk_block(x, y, 15, F(-1.0), 20, L)
    for c in range(4):
        for i in range(32):
            y[16 + 32 * c + i] = np.uint8(L[64 * c + i] | (L[64 * c + i + 32] << 4))


@njit(cache=True)
def _q5_k_block(x, y):  # x [256] f32 -> y [176] u8
    L = np.zeros(QK_K, np.int64)
    _qk_block(x, y, 31, F(-0.5), 15, L)
    m1, m2 = 1, 2
    for c in range(4):
        for i in range(32):
            l1, l2 = L[64 * c + i], L[64 * c + i + 32]
            if l1 > 15:
                l1 -= 16
                y[16 + i] |= np.uint8(m1)
            if l2 > 15:
                l2 -= 16
                y[16 + i] |= np.uint8(m2)
            y[48 + 32 * c + i] = np.uint8(l1 | (l2 << 4))
        m1, m2 = m1 << 2, m2 << 2


@njit(cache=True)
def _q6_k_block(x, y):  # x [256] f32 -> y [210] u8
    L = np.zeros(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    max_scale, max_abs = F(0), F(0)
    for j in range(16):
        scales[j] = _qx_quants(x[16 * j:16 * j + 16], L[16 * j:16 * j + 16], 32)
        if abs(scales[j]) > max_abs:
            max_abs, max_scale = abs(scales[j]), scales[j]
    y[:] = 0
    if max_abs < _EPS:
        return
    iscale = F(-128) / max_scale
    _put_f16(y, 208, F(1) / iscale)
    for j in range(16):
        y[192 + j] = np.uint8(min(127, _nearest(iscale * scales[j])) & 255)
    dd = f16_to_f32(np.uint16(y[208]) | (np.uint16(y[209]) << 8))
    for j in range(16):
        sc = np.int64(y[192 + j])
        d = dd * F(sc - 256 if sc > 127 else sc)
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, _nearest(x[16 * j + i] / d))) + 32
    for h in range(2):
        j = 128 * h
        for i in range(32):
            y[64 * h + i] = np.uint8((L[j + i] & 15) | ((L[j + i + 64] & 15) << 4))
            y[64 * h + i + 32] = np.uint8((L[j + i + 32] & 15) | ((L[j + i + 96] & 15) << 4))
            y[128 + 32 * h + i] = np.uint8((L[j + i] >> 4) | ((L[j + i + 32] >> 4) << 2) | ((L[j + i + 64] >> 4) << 4)
                                           | ((L[j + i + 96] >> 4) << 6))


def _k_codec(block_fn, nbytes: int) -> Codec:
    def body(x, out):  # x [nb, 256] -> out [nb, bytes]
        for i in prange(x.shape[0]):
            block_fn(x[i], out[i])

    rows = Kernel(body)  # serial below PARALLEL_MIN_WORK (toolkit/cpu/_jit.py)

    def quantize(w: np.ndarray, fmt: Format) -> dict:
        x = np.ascontiguousarray(w, np.float32).reshape(-1, QK_K)
        out = np.empty((x.shape[0], nbytes), np.uint8)
        rows(x.size, x, out)
        return {"blocks": out.reshape(*w.shape[:-1], -1)}

    return Codec(quantize, _dequantize)


# ---- the records ---------------------------------------------------------------------------------------------
def _checked_scales(name: str):
    """The block's f16 fields (d, and dmin or m) as floats, for the NaN / inf check of files read; the codes are not
    unpacked."""
    spec = SPECS[name]

    def scales(arrays) -> list:
        b = np.asarray(arrays["blocks"], np.uint8).reshape(-1, spec.bytes)
        return [np.ascontiguousarray(b[:, o:o + 2]).view(np.float16) for o in spec.halves]

    return scales


_QUANTIZE = {"q2_k": _q2_k_block, "q3_k": _q3_k_block, "q4_k": _q4_k_block, "q5_k": _q5_k_block,
             "q6_k": _q6_k_block}
_DOCS = {"q4_1": "GGML q4_1: blocks of 32, f16 scale and min", "q5_0": "GGML q5_0: blocks of 32, 5-bit, f16 scale",
         "q5_1": "GGML q5_1: blocks of 32, 5-bit, f16 scale and min",
         "q2_k": "GGML q2_K: super-blocks of 256, 2-bit, 4-bit scales and mins per 16",
         "q3_k": "GGML q3_K: super-blocks of 256, 3-bit, 6-bit scales per 16",
         "q4_k": "GGML q4_K: super-blocks of 256, 4-bit, 6-bit scales and mins per 32",
         "q5_k": "GGML q5_K: super-blocks of 256, 5-bit, 6-bit scales and mins per 32",
         "q6_k": "GGML q6_K: super-blocks of 256, 6-bit, 8-bit scales per 16"}
_CUDA = {"q4_1": "Q4_1Dec", "q5_0": "Q5_0Dec", "q5_1": "Q5_1Dec", "q2_k": "Q2_KDec", "q3_k": "Q3_KDec",
         "q4_k": "Q4_KDec", "q5_k": "Q5_KDec", "q6_k": "Q6_KDec"}


INT_FORMS = {"q4_k": "kquant"}  # the k-quants the integer GEMMs run (toolkit/formats/int_form.py): 4-bit codes, a
# scale and a min per block of 32; q5_K's 5-bit codes have no packed layout there, the others scale per 16 values


def _record(name: str) -> Format:
    s = SPECS[name]
    codec = _k_codec(_QUANTIZE[name], s.bytes) if name in _QUANTIZE else Codec(_quantize_gguf, _dequantize)
    return Format(name=name, kind="ggml", bits=s.code_bits, group_size=s.values, doc=_DOCS[name],
                  layout=_layout, scales=_checked_scales(name), block=(s.values, s.bytes), max_abs=65504.0,
                  cpu_decoder=name, cuda_decoder=_CUDA[name], uqff_tag=0, ggml_type=s.type_id, offered=False,
                  codecs={"numpy": codec, "numba": codec}, int_form=INT_FORMS.get(name))


FORMATS = tuple(_record(n) for n in SPECS)
BY_TYPE_ID = {f.ggml_type: f for f in FORMATS}


__all__ = ["BY_TYPE_ID", "FORMATS", "Fields", "SPECS", "dequantize_raw", "fields", "q4_k_blocks"]
