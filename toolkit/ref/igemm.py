"""igemm: the grouped GEMM on 8-bit activations and integer weight codes (the spec of ``toolkit/cpu/igemm.py``).

Shapes: ``T`` tokens, ``R`` gathered rows (routed slots), ``E`` experts, ``N`` output rows, ``K`` inputs,
``B = K / 32`` activation blocks, ``G`` weight groups (scale groups) along K.

1. Activations, quantized once per token (``quantize_act``): per row ``r`` and block ``b`` of 32 along K,
   all in float32:  ``d = max|x[r, 32b : 32b + 32]| / 127``;  ``inv = 1 / d`` (0 where d == 0);
   ``code = clip(rint(x * inv), -127, 127)`` as int8 (``rint``: round half to even, NumPy's and LLVM's);
   ``scale[r, b] = d`` (float32, not rounded to f16). q8_0 differs in two points: it rounds half away from
   zero and stores d as f16. Dequantized activations are ``code * scale``.
2. Weights as integers (``int_weight``): every supported format is ``w[e, n, k] = S[e, n, k // (32 * bpg)] *
   (c[e, n, k] + o) + Z[e, n, k // g]``: non-negative integer codes ``c`` (< 256), one integer offset ``o``,
   f32 scales ``S`` per group of ``bpg`` blocks, f32 offsets ``Z`` (affine formats only):
     int8  (channel):    c = q + 128 (0..255), o = -128, S = s[n] (bpg = B),     Z none
     q8_0  (block 32):   c = qs + 128,         o = -128, S = d (f16 -> f32),     Z none
     q4_0  (block 32):   c = q (0..15),        o = -8,   S = d,                  Z none
     int4/3/2 (group g): c = q (0..2^b - 1),  o = 0,    S = s_g (f16 -> f32),   Z = z_g (bpg = g / 32)
   (the biased 8-bit codes make every code unsigned: the kernel's u8 x s8 products; the offset is paid
   once per block through the activation block sums). fp8 (e4m3) is not integer: its codes span
   2^-9 .. 448, i.e. 19 bits of fixed point, so no exact int8 / int16 form exists; fp8 stays on the f32 path.
3. The product (``igemm``), for a gathered row ``r`` of expert ``e`` and output row ``n``:
     P[r, n, b] = sum_{k in block b} code[r, k] * (c[e, n, k] + o)          exact integer (|P| < 2^22)
     y[r, n]    = sum_b scale[r, b] * S[e, n, g(b)] * P[r, n, b]  +  sum_g Z[e, n, g] * A[r, g],
     A[r, g]    = sum_{b in group g} scale[r, b] * xsum[r, b],   xsum[r, b] = sum_{k in b} code[r, k].
   The reference evaluates y in float64 (exact products, sums rounded at 2^-53) and rounds once to f32.
   Mathematically ``y = x_hat @ dequant(w)^T`` with ``x_hat`` the dequantized activations: the integer
   path is the f32 path run on ``x_hat`` (``dequant_act``), which is how its quality cost is measured.
4. The kernel's tolerance (``error_bound``): it sums the same terms in f32 (per block one fused
   multiply-add of float(P) by the f32 product scale * S; the Z terms likewise), so
     |y_kernel - y_ref| <= (B + G + 4) * 2^-23 * (sum_b |scale * S * P| + sum_g |Z * A|)   (+ f32 underflow),
   the standard bound for a recursive f32 sum of B + G terms, each with two roundings. Integer parts
   (P, xsum) are exact: with power-of-two scales every step is exact and the kernel equals the reference
   bit for bit (the tests use this).
"""
from __future__ import annotations

import numpy as np

from ..formats.packing import unpack_ref

QK = 32  # activation block (values along K)


# ---- 1. activations ---------------------------------------------------------------------------------------
def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [R, K] (K % 32 == 0) -> (codes int8 [R, K], scales f32 [R, K / 32])."""
    x = np.asarray(x, np.float32)
    R, K = x.shape
    if K % QK:
        raise ValueError(f"quantize_act: K={K} is not a multiple of {QK}")
    xb = x.reshape(R, K // QK, QK)  # [R, B, 32]
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)  # [R, B]
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    codes = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(R, K), d


def dequant_act(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The activations the integer path multiplies: codes [R, K] int8, scales [R, B] -> f32 [R, K]."""
    R, K = codes.shape
    return (codes.reshape(R, -1, QK).astype(np.float32) * scales[..., None]).reshape(R, K)


def act_sums(codes: np.ndarray) -> np.ndarray:
    """codes [R, K] -> int32 [R, B]: the block sums that carry the weight offsets."""
    return codes.reshape(codes.shape[0], -1, QK).sum(axis=-1, dtype=np.int32)


# ---- 2. weights as integers ------------------------------------------------------------------------------
def _f16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.float16).astype(np.float32)


def int_weight(w) -> dict:
    """QTensor [E, N, K] (or [N, K]) -> {'c': uint8 [E, N, K], 'o': int, 'S': f32 [E, N, GS], 'bpg': int,
    'Z': f32 [E, N, G] or None, 'g': int (values per Z group)}; raises NotImplementedError for other formats."""
    fmt, (N, K) = w.fmt, w.shape[-2:]
    E = int(np.prod(w.shape[:-2], dtype=np.int64))
    if K % QK:
        raise NotImplementedError(f"igemm: K={K} of {fmt.spec} is not a multiple of {QK}")
    B = K // QK
    if fmt.kind == "channel" and fmt.bits == 8 and np.dtype(w.arrays["qweight"].dtype) == np.int8:  # int8
        q = w.arrays["qweight"].reshape(E, N, K)
        return dict(c=(q.astype(np.int16) + 128).astype(np.uint8), o=-128,
                    S=w.arrays["scales"].reshape(E, N, 1).astype(np.float32), bpg=B, Z=None, g=K)
    if fmt.kind == "block":
        bpb = 34 if fmt.bits == 8 else 18
        blk = w.arrays["blocks"].reshape(E, N, B, bpb)
        S = _f16(np.ascontiguousarray(blk[..., :2])).reshape(E, N, B)
        if fmt.bits == 8:  # q8_0: int8 qs
            c = (blk[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return dict(c=c.reshape(E, N, K), o=-128, S=S, bpg=1, Z=None, g=K)
        qs = blk[..., 2:]  # q4_0: element j low nibble of byte j, element j + 16 its high nibble
        c = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)
        return dict(c=c.reshape(E, N, K), o=-8, S=S, bpg=1, Z=None, g=K)
    if fmt.kind == "affine":
        g = fmt.group_size
        c = unpack_ref(w.arrays["qweight"].reshape(E, N, -1), fmt.bits, K)
        return dict(c=c, o=0, S=_f16(w.arrays["scales"]).reshape(E, N, K // g), bpg=g // QK,
                    Z=_f16(w.arrays["biases"]).reshape(E, N, K // g), g=g)
    raise NotImplementedError(f"igemm: format {fmt.spec!r} has no exact integer form (kind {fmt.kind}, "
                              f"{fmt.bits} bits); keep it on the f32 path")


def supported(fmt) -> bool:
    return (fmt.kind in ("block", "affine") or (fmt.kind == "channel" and fmt.bits == 8 and fmt.act_quant is None))


# ---- 3. the product --------------------------------------------------------------------------------------
def _terms(codes, scales, iw, e, rows):
    """The block terms of rows ``rows`` against expert e: (sx*S*P [r, N, B], Z*A [r, N, G] or None), float64."""
    K = codes.shape[1]
    B = K // QK
    x = codes[rows].astype(np.int64).reshape(len(rows), B, QK)  # [r, B, 32]
    c = iw["c"][e].astype(np.int64) + iw["o"]  # [N, K]
    N = c.shape[0]
    P = np.einsum("rbk,nbk->rnb", x, c.reshape(N, B, QK))  # exact int64 [r, N, B]
    S = np.repeat(iw["S"][e].astype(np.float64), iw["bpg"], axis=1)[:, :B]  # [N, B]
    t = scales[rows].astype(np.float64)[:, None, :] * S[None] * P  # [r, N, B]
    if iw["Z"] is None:
        return t, None
    A = group_act_sums(codes[rows], scales[rows], iw["g"])  # [r, G] float64
    return t, iw["Z"][e].astype(np.float64)[None] * A[:, None, :]  # [r, N, G]


def group_act_sums(codes: np.ndarray, scales: np.ndarray, g: int) -> np.ndarray:
    """A [R, G] = sum over the blocks of each group of scale * block sum (float64)."""
    t = scales.astype(np.float64) * act_sums(codes)  # [R, B]
    return t.reshape(t.shape[0], -1, g // QK).sum(axis=-1)


def igemm(codes, scales, w, seg_e, seg_lo, seg_hi, rows=None) -> np.ndarray:
    """codes int8 [T, K], scales f32 [T, B]; w QTensor [E, N, K]; segments over the gathered rows
    (row i of the result reads activation row ``rows[i]``, default i) -> f32 [R, N] (rows outside every
    segment stay 0)."""
    iw = int_weight(w)
    R = int(max(seg_hi)) if len(seg_hi) else 0
    rows = np.arange(R) if rows is None else np.asarray(rows)
    out = np.zeros((R, w.shape[-2]), np.float32)
    for e, lo, hi in zip(seg_e, seg_lo, seg_hi):
        t, z = _terms(codes, scales, iw, int(e), rows[lo:hi])
        y = t.sum(axis=2) + (0 if z is None else z.sum(axis=2))
        out[lo:hi] = y.astype(np.float32)
    return out


# ---- 4. tolerance and the cost of 8-bit activations --------------------------------------------------------
def term_magnitude(codes, scales, w, seg_e, seg_lo, seg_hi, rows=None) -> tuple[np.ndarray, int]:
    """(float64 [R, N] sum of |terms| of section 3, number of terms per output)."""
    iw = int_weight(w)
    R = int(max(seg_hi)) if len(seg_hi) else 0
    rows = np.arange(R) if rows is None else np.asarray(rows)
    out = np.zeros((R, w.shape[-2]), np.float64)
    n_terms = 0
    for e, lo, hi in zip(seg_e, seg_lo, seg_hi):
        t, z = _terms(codes, scales, iw, int(e), rows[lo:hi])
        out[lo:hi] = np.abs(t).sum(axis=2) + (0 if z is None else np.abs(z).sum(axis=2))
        n_terms = t.shape[2] + (0 if z is None else z.shape[2])
    return out, n_terms


def error_bound(codes, scales, w, seg_e, seg_lo, seg_hi, rows=None) -> np.ndarray:
    """float64 [R, N]: the bound of section 4 on |kernel - igemm| per output."""
    mag, n_terms = term_magnitude(codes, scales, w, seg_e, seg_lo, seg_hi, rows)
    return (n_terms + 4) * 2.0 ** -23 * mag + 1e-30


def activation_error(x, w, seg_e, seg_lo, seg_hi) -> dict:
    """What 8-bit activations change: the integer path against the f32-activation path on the same
    (dequantized) weights, for gathered rows x f32 [R, K]. Returns {'int': [R, N], 'f32': [R, N],
    'max_abs', 'rel_rms'} (rel_rms: RMS of the difference over RMS of the f32 result)."""
    x = np.asarray(x, np.float32)
    codes, scales = quantize_act(x)
    got = igemm(codes, scales, w, seg_e, seg_lo, seg_hi)
    wd = w.dequantize("numpy").reshape(-1, *w.shape[-2:])
    want = np.zeros_like(got)
    for e, lo, hi in zip(seg_e, seg_lo, seg_hi):
        want[lo:hi] = (x[lo:hi].astype(np.float64) @ wd[e].T.astype(np.float64)).astype(np.float32)
    d = got.astype(np.float64) - want
    rms = float(np.sqrt((want.astype(np.float64) ** 2).mean())) or 1.0
    return {"int": got, "f32": want, "max_abs": float(np.abs(d).max(initial=0.0)),
            "rel_rms": float(np.sqrt((d ** 2).mean())) / rms}
