"""igemm: the grouped GEMM on 8-bit activations and integer weight codes (the spec of ``toolkit/cpu/igemm.py``).

Shapes: ``T`` tokens, ``R`` gathered rows (routed slots), ``E`` experts, ``N`` output rows, ``K`` inputs,
``B = K / 32`` activation blocks, ``G`` weight groups (scale groups) along K.

1. Activations, quantized once per token (``quantize_act``): per row ``r`` and block ``b`` of 32 along K,
   all in float32:  ``d = max|x[r, 32b : 32b + 32]| / 127``;  ``inv = 1 / d`` (0 where d == 0);
   ``code = clip(rint(x * inv), -127, 127)`` as int8 (``rint``: round half to even, NumPy's and LLVM's);
   ``scale[r, b] = d`` (float32, not rounded to f16). q8_0 differs in two points: it rounds half away from
   zero and stores d as f16. Dequantized activations are ``code * scale``.
2. Weights as integers (``int_weight``, ``toolkit/formats/int_form.py``: a fact of each format's record):
   ``w[e, n, k] = S[e, n, k // (32 * bpg)] * (c[e, n, k] + o) + Z[e, n, k // g]``, codes ``c`` < 256.
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
   the standard bound for a recursive f32 sum of B + G terms, each with two roundings. q4_K's kernels sum each
   super-block of 8 blocks apart (``float(P) * (sc * sx)``), then add ``d`` times it and ``-dmin`` times the
   super-block's ``sum m * A`` to the total: at most 8 + 3 roundings a term plus B / 8 in the total, inside it. Integer parts
   (P, xsum) are exact: with power-of-two scales every step is exact and the kernel equals the reference
   bit for bit (the tests use this).
"""
from __future__ import annotations

import numpy as np

from ..formats.int_form import QK, int_weight, supported  # noqa: F401 - the spec's weights


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
