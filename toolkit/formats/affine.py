"""int4 / int3 / int2: asymmetric group-wise weights (affine, as MLX and mistral.rs AFQ define it).

Per group of ``g`` consecutive weights of a row (g in 32, 64, 128; default 64):
``s = (max - min) / (2**b - 1)`` and ``z = min``, both stored as float16; codes
``q = clip(rint((w - z) / s), 0, 2**b - 1)`` computed with the stored (f16-rounded) ``s`` and ``z``;
dequantize ``w = q * s + z``. Codes are packed densely (:mod:`toolkit.formats.packing`): 3 bits per
weight for int3, not 4.
Arrays: ``qweight`` uint8 [..., N, K*b/8], ``scales`` f16 [..., N, G], ``biases`` f16 [..., N, G].
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..cpu._jit import kernel
from ..errors import FormatError
from .base import ArraySpec, Codec, Format
from .packing import pack_numba, pack_ref, packed_len, unpack_numba, unpack_ref
from .scalar import f16_bits, f16_to_f32, f16_value, f32_to_f16

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = 64


def layout(fmt: Format, shape: tuple) -> dict:
    n_groups = shape[-1] // fmt.group_size
    return {
        "qweight": ArraySpec(np.dtype(np.uint8), shape[:-1] + (packed_len(shape[-1], fmt.bits),)),
        "scales": ArraySpec(np.dtype(np.float16), shape[:-1] + (n_groups,)),
        "biases": ArraySpec(np.dtype(np.float16), shape[:-1] + (n_groups,)),
    }


def _check_half_range(scale_bits: np.ndarray, bias_bits: np.ndarray, w: np.ndarray) -> None:
    bad = ((scale_bits & 0x7C00) == 0x7C00) | ((bias_bits & 0x7C00) == 0x7C00)
    if bad.any():
        raise FormatError(
            f"values up to {float(np.abs(w).max()):.4g} exceed the float16 range (65504) of group scales/offsets"
        )


# ---- NumPy reference -----------------------------------------------------------------------------------
def quantize_ref(w: np.ndarray, fmt: Format) -> dict:
    g, qmax = fmt.group_size, (1 << fmt.bits) - 1
    wg = w.reshape(*w.shape[:-1], w.shape[-1] // g, g)  # [..., N, G, g]
    wmin, wmax = wg.min(axis=-1), wg.max(axis=-1)  # [..., N, G]
    s_bits = f16_bits((wmax - wmin) / np.float32(qmax))
    z_bits = f16_bits(wmin)
    _check_half_range(s_bits, z_bits, w)
    s, z = f16_value(s_bits)[..., None], f16_value(z_bits)[..., None]
    safe = np.where(s == 0, np.float32(1), s)
    q = np.where(s == 0, np.float32(0), np.clip(np.rint((wg - z) / safe), 0, qmax)).astype(np.uint8)
    return {
        "qweight": pack_ref(q.reshape(w.shape), fmt.bits),
        "scales": s_bits.view(np.float16),
        "biases": z_bits.view(np.float16),
    }


def dequantize_ref(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    g = fmt.group_size
    q = unpack_ref(arrays["qweight"], fmt.bits, shape[-1]).astype(np.float32)
    q = q.reshape(*shape[:-1], shape[-1] // g, g)
    s = arrays["scales"].astype(np.float32)[..., None]
    z = arrays["biases"].astype(np.float32)[..., None]
    return (q * s + z).reshape(shape)


# ---- Numba -------------------------------------------------------------------------------------------
@kernel()  # serial below PARALLEL_MIN_WORK (toolkit/cpu/_jit.py)
def _quantize_rows(w, g, qmax, q, s_bits, z_bits):  # w [R, K] -> q [R, K] u8 codes, s/z [R, G] u16
    n_groups = w.shape[1] // g
    for r in prange(w.shape[0]):
        for gi in range(n_groups):
            lo = w[r, gi * g]
            hi = lo
            for k in range(gi * g, (gi + 1) * g):
                lo = min(lo, w[r, k])
                hi = max(hi, w[r, k])
            sb = f32_to_f16((hi - lo) / np.float32(qmax))
            zb = f32_to_f16(lo)
            s_bits[r, gi] = sb
            z_bits[r, gi] = zb
            s = f16_to_f32(sb)
            z = f16_to_f32(zb)
            for k in range(gi * g, (gi + 1) * g):
                if s == 0:
                    q[r, k] = 0
                else:
                    v = np.rint((w[r, k] - z) / s)
                    q[r, k] = np.uint8(min(max(v, np.float32(0.0)), np.float32(qmax)))


@kernel()
def _dequantize_rows(q, s_bits, z_bits, g, out):  # q [R, K] codes -> out [R, K] f32
    n_groups = q.shape[1] // g
    for r in prange(q.shape[0]):
        for gi in range(n_groups):
            s = f16_to_f32(s_bits[r, gi])
            z = f16_to_f32(z_bits[r, gi])
            for k in range(gi * g, (gi + 1) * g):
                out[r, k] = np.float32(q[r, k]) * s + z


def quantize_numba(w: np.ndarray, fmt: Format) -> dict:
    k, g = w.shape[-1], fmt.group_size
    w2 = w.reshape(-1, k)
    q = np.empty(w2.shape, np.uint8)
    s_bits = np.empty((w2.shape[0], k // g), np.uint16)
    z_bits = np.empty_like(s_bits)
    _quantize_rows(w2.size, w2, g, (1 << fmt.bits) - 1, q, s_bits, z_bits)
    _check_half_range(s_bits, z_bits, w)
    lead = w.shape[:-1]
    return {
        "qweight": pack_numba(q, fmt.bits).reshape(*lead, -1),
        "scales": s_bits.view(np.float16).reshape(*lead, k // g),
        "biases": z_bits.view(np.float16).reshape(*lead, k // g),
    }


def dequantize_numba(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    k = shape[-1]
    q = unpack_numba(arrays["qweight"], fmt.bits, k).reshape(-1, k)
    s_bits = np.ascontiguousarray(arrays["scales"]).view(np.uint16).reshape(q.shape[0], -1)
    z_bits = np.ascontiguousarray(arrays["biases"]).view(np.uint16).reshape(q.shape[0], -1)
    out = np.empty(q.shape, np.float32)
    _dequantize_rows(out.size, q, s_bits, z_bits, fmt.group_size, out)
    return out.reshape(shape)


def _affine(bits: int) -> Format:
    return Format(name=f"int{bits}", kind="affine", bits=bits, group_size=DEFAULT_GROUP,
                  doc=f"int{bits} asymmetric group-wise (f16 scale and offset per group), densely packed",
                  layout=layout, group_sizes=GROUP_SIZES, max_abs=65504.0,
                  codecs={"numpy": Codec(quantize_ref, dequantize_ref), "numba": Codec(quantize_numba, dequantize_numba)},
                  cpu_decoder=f"affine{bits}", cuda_decoder=f"AffineDec<{bits}>", uqff_tag=100, int_form="affine")


INT4, INT3, INT2 = _affine(4), _affine(3), _affine(2)
FORMATS = (INT4, INT3, INT2)
