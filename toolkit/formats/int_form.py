"""The exact integer form of a weight format: what the integer GEMMs (``toolkit/ref/igemm.py``, the spec, and
``toolkit/cpu/igemm.py``) multiply. A format has one when its record names it (``Format.int_form``).

Every such format is ``w[e, n, k] = S[e, n, k // (32 * bpg)] * (c[e, n, k] + o) + Z[e, n, k // g]``: non-negative
integer codes ``c`` (< 256), one integer offset ``o``, f32 scales ``S`` per group of ``bpg`` blocks of 32, f32
offsets ``Z`` (the affine form only):
  "channel8" (int8):       c = q + 128 (0..255), o = -128, S = s[n] (bpg = K / 32), Z none
  "block" q8_0 (32):       c = qs + 128,         o = -128, S = d (f16 -> f32),       Z none
  "block" q4_0 (32):       c = q (0..15),        o = -8,   S = d,                    Z none
  "affine" int4/3/2 (g):   c = q (0..2^b - 1),   o = 0,    S = s_g (f16 -> f32),     Z = z_g (bpg = g / 32)
  "kquant" q4_K:           c = q (0..15),        o = 0,    S = d * sc_b,             Z = -dmin * m_b (bpg = 1, g = 32)
      (per block b of 32: 6-bit sc_b, m_b; per super-block of 256: f16 d, dmin; both products exact in f32, and the
      values ggml's ``dequantize_row_q4_K`` computes: ``d1 * q - m1``)
(the biased 8-bit codes make every code unsigned: the kernel's u8 x s8 products; the offset is paid once per
block through the activation block sums). fp8 (e4m3) has none: its codes span 2^-9 .. 448, i.e. 19 bits of
fixed point, so no exact int8 / int16 form exists; fp8 stays on the f32 path.
"""
from __future__ import annotations

import numpy as np

from .packing import unpack_ref

QK = 32  # activation block of the integer GEMMs (values along K)


def _f16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.float16).astype(np.float32)


def _channel8(w, E, N, K, B):
    q = w.arrays["qweight"].reshape(E, N, K)
    return dict(c=(q.astype(np.int16) + 128).astype(np.uint8), o=-128,
                S=w.arrays["scales"].reshape(E, N, 1).astype(np.float32), bpg=B, Z=None, g=K)


def _block(w, E, N, K, B):
    bits = w.fmt.bits
    blk = w.arrays["blocks"].reshape(E, N, B, 2 + QK * bits // 8)  # f16 scale, then the codes
    S = _f16(np.ascontiguousarray(blk[..., :2])).reshape(E, N, B)
    if bits == 8:  # q8_0: int8 qs
        c = (blk[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return dict(c=c.reshape(E, N, K), o=-128, S=S, bpg=1, Z=None, g=K)
    qs = blk[..., 2:]  # q4_0: element j low nibble of byte j, element j + 16 its high nibble
    c = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)
    return dict(c=c.reshape(E, N, K), o=-8, S=S, bpg=1, Z=None, g=K)


def _affine(w, E, N, K, B):
    g, bits = w.fmt.group_size, w.fmt.bits
    c = unpack_ref(w.arrays["qweight"].reshape(E, N, -1), bits, K)
    return dict(c=c, o=0, S=_f16(w.arrays["scales"]).reshape(E, N, K // g), bpg=g // QK,
                Z=_f16(w.arrays["biases"]).reshape(E, N, K // g), g=g)


def _kquant(w, E, N, K, B):
    from .kquant import SPECS, fields

    f = fields(w.fmt.name, w.arrays["blocks"])  # [E * N * K / 256 super-blocks, ...]
    d, dmin = _f16(f.d)[:, None], _f16(f.dmin)[:, None]
    S = (d * f.sc.astype(np.float32)).reshape(E, N, B)
    Z = -(dmin * f.m.astype(np.float32)).reshape(E, N, B)
    return dict(c=f.codes.reshape(E, N, K), o=-SPECS[w.fmt.name].off, S=S, bpg=1, Z=Z, g=QK)


FORMS = {"channel8": _channel8, "block": _block, "affine": _affine, "kquant": _kquant}  # Format.int_form -> its reading


def supported(fmt) -> bool:
    return fmt.int_form in FORMS


def int_weight(w) -> dict:
    """QTensor [E, N, K] (or [N, K]) -> {'c': uint8 [E, N, K], 'o': int, 'S': f32 [E, N, GS], 'bpg': int,
    'Z': f32 [E, N, G] or None, 'g': int (values per Z group)}; raises NotImplementedError for other formats."""
    fmt, (N, K) = w.fmt, w.shape[-2:]
    E = int(np.prod(w.shape[:-2], dtype=np.int64))
    if K % QK:
        raise NotImplementedError(f"igemm: K={K} of {fmt.spec} is not a multiple of {QK}")
    if not supported(fmt):
        raise NotImplementedError(f"igemm: format {fmt.spec!r} has no exact integer form; keep it on the f32 path")
    return FORMS[fmt.int_form](w, E, N, K, K // QK)
