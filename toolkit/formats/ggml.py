"""GGML blocks of 32 along K: q8_0, q4_0 and mxfp4, byte-identical to ggml (and to PyPI ``gguf.quants``).

q8_0 block (34 bytes): ``{f16 d; int8 qs[32]}``, ``d = absmax / 127``, ``qs = round_half_away(x / d)``.
q4_0 block (18 bytes): ``{f16 d; uint8 qs[16]}``; ``m`` = the value of largest magnitude (first one on a
tie, sign kept), ``d = m / -8``, ``q = min(15, trunc(x / d + 8.5))``; element ``j < 16`` is the low nibble
of byte ``j``, element ``j + 16`` its high nibble; dequant ``(q - 8) * d``.
Both compute ``x * (1 / d)`` in float32 exactly as ggml does.
mxfp4 block (17 bytes, OCP MX v1.0, GGML type 39): ``{u8 e; uint8 qs[16]}``; ``e`` an e8m0 shared exponent
(``e = floor(log2(absmax)) - 2 + 127``, 0 for an all-zero block), codes e2m1 (sign, 2-bit exponent, 1-bit
mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6), the nearest to ``x / 2**(e - 127)`` (first of the table on a tie), nibbles
as q4_0; dequant ``2**(e - 127) * e2m1(q)``, as ggml (``e8m0_to_fp32_half(e) * kvalues[q]``, kvalues doubled).
Array: ``blocks`` uint8 [..., N, B * bytes].
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .base import ArraySpec, Codec, Format
from .scalar import f16_bits, f16_to_f32, f16_value, f32_to_f16

QK = 32  # values per block


def _layout(block_bytes: int):
    def layout(fmt: Format, shape: tuple) -> dict:
        return {"blocks": ArraySpec(np.dtype(np.uint8), shape[:-1] + (shape[-1] // QK * block_bytes,))}

    return layout


def _block_scales(arrays) -> list:
    """The f16 scale ``d`` that opens every block."""
    return [np.ascontiguousarray(arrays["blocks"][..., 0:2]).view(np.float16)]


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


# ---- NumPy reference: q8_0 ----------------------------------------------------------------------------
def q8_0_quantize_ref(w: np.ndarray, fmt: Format) -> dict:
    b = w.reshape(-1, QK)  # [nb, 32]
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    v = b * _inverse(d)
    a = np.abs(v)
    qs = (np.sign(v) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))).astype(np.int8)  # round half away
    out = np.concatenate([f16_bits(d).view(np.uint8).reshape(-1, 2), qs.view(np.uint8)], axis=-1)
    return {"blocks": out.reshape(*w.shape[:-1], -1)}


def q8_0_dequantize_ref(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    blk = arrays["blocks"].reshape(-1, 34)
    d = f16_value(blk[:, :2].copy().view(np.uint16))  # [nb, 1]
    return (blk[:, 2:].view(np.int8).astype(np.float32) * d).reshape(shape)


# ---- NumPy reference: q4_0 ----------------------------------------------------------------------------
def q4_0_quantize_ref(w: np.ndarray, fmt: Format) -> dict:
    b = w.reshape(-1, QK)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[:, None], axis=-1)  # [nb, 1], sign kept
    d = (m / np.float32(-8)).astype(np.float32)
    q = np.trunc(b * _inverse(d) + np.float32(8.5)).astype(np.float32).astype(np.uint8).clip(0, 15)
    qs = q[:, :16] | (q[:, 16:] << np.uint8(4))
    out = np.concatenate([f16_bits(d).view(np.uint8).reshape(-1, 2), qs], axis=-1)
    return {"blocks": out.reshape(*w.shape[:-1], -1)}


def q4_0_dequantize_ref(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    blk = arrays["blocks"].reshape(-1, 18)
    d = f16_value(blk[:, :2].copy().view(np.uint16))
    qs = blk[:, 2:]
    q = np.concatenate([qs & np.uint8(0xF), qs >> np.uint8(4)], axis=-1).astype(np.float32) - np.float32(8)
    return (q * d).reshape(shape)


# ---- NumPy reference: mxfp4 ---------------------------------------------------------------------------
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # code -> value
_KVALUES = (2 * E2M1).astype(np.float32)  # ggml's doubled table (its d is half the e8m0 scale)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's ``e8m0_to_fp32_half``: 2**(e - 128) as float32, exact (subnormal for e < 2)."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def mxfp4_quantize_ref(w: np.ndarray, fmt: Format) -> dict:
    b = w.reshape(-1, QK).astype(np.float32)  # [nb, 32]
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).clip(0, 254).astype(np.uint8)  # [nb, 1]
    err = np.abs(e8m0_half(e)[:, :, None] * _KVALUES - b[:, :, None])  # [nb, 32, 16]
    q = err.argmin(axis=-1).astype(np.uint8)  # first index on a tie, as numpy / ggml
    qs = q[:, :16] | (q[:, 16:] << np.uint8(4))
    return {"blocks": np.concatenate([e, qs], axis=-1).reshape(*w.shape[:-1], -1)}


def mxfp4_dequantize_ref(arrays, fmt: Format, shape: tuple) -> np.ndarray:
    blk = arrays["blocks"].reshape(-1, 17)
    qs = blk[:, 1:]
    q = np.concatenate([qs & np.uint8(0xF), qs >> np.uint8(4)], axis=-1)  # [nb, 32]
    return (e8m0_half(blk[:, :1]) * _KVALUES[q]).reshape(shape)


def mxfp4_blocks_from_ocp(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss / OCP storage (``*_blocks`` u8 [..., G, 16] with element 2i in the low nibble of byte i, ``*_scales``
    u8 e8m0 [..., G]) -> our GGML blocks u8 [..., G * 17]: a byte permutation, nothing dequantized."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up "
                         f"(need [..., G, 16] and [..., G])")
    codes = np.stack([blocks & np.uint8(15), blocks >> np.uint8(4)], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << np.uint8(4))  # element j < 16 low nibble of byte j, as ggml
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


def mxfp4_blocks_to_ocp(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`mxfp4_blocks_from_ocp`: our blocks u8 [..., G * 17] -> (``*_blocks`` u8 [..., G, 16],
    ``*_scales`` u8 [..., G]) as gpt-oss checkpoints store them."""
    b = np.asarray(blocks, np.uint8)
    b = b.reshape(*b.shape[:-1], b.shape[-1] // 17, 17)
    qs = b[..., 1:]
    codes = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)  # [..., G, 32] in element order
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))), np.ascontiguousarray(b[..., 0])


def _mxfp4_scales(arrays) -> list:
    """e8m0 255 is NaN in OCP MX: surfaced as NaN for the finite check of files read."""
    e = np.ascontiguousarray(arrays["blocks"]).reshape(-1, 17)[:, 0]
    return [np.where(e == 255, np.float32(np.nan), np.float32(0))]


# ---- Numba block codecs (one block at a time; reused by the KV cache store) --------------------------
@njit(cache=True, inline="always")
def q8_0_quantize_block(x, out):  # x [32] f32 -> out [34] u8
    amax = np.float32(0.0)
    for i in range(QK):
        amax = max(amax, abs(x[i]))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    h = f32_to_f16(d)
    out[0] = np.uint8(h & 0xFF)
    out[1] = np.uint8(h >> 8)
    for i in range(QK):
        v = x[i] * inv
        a = math.floor(abs(float(v)) + 0.5)  # round half away from zero (exact in f64)
        q = np.int64(a) if v >= 0 else -np.int64(a)
        out[2 + i] = np.uint8(q & 0xFF)


@njit(cache=True, inline="always")
def q4_0_quantize_block(x, out):  # x [32] f32 -> out [18] u8
    m = x[0]
    for i in range(1, QK):
        if abs(x[i]) > abs(m):
            m = x[i]
    d = m / np.float32(-8.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    h = f32_to_f16(d)
    out[0] = np.uint8(h & 0xFF)
    out[1] = np.uint8(h >> 8)
    for j in range(16):
        lo = min(np.int64(math.trunc(x[j] * inv + np.float32(8.5))), 15)
        hi = min(np.int64(math.trunc(x[j + 16] * inv + np.float32(8.5))), 15)
        out[2 + j] = np.uint8(max(lo, 0) | (max(hi, 0) << 4))


@njit(cache=True, inline="always")
def q8_0_dequantize_block(blk, out):  # blk [34] u8 -> out [32] f32
    d = f16_to_f32(np.uint16(blk[0]) | (np.uint16(blk[1]) << np.uint16(8)))
    for i in range(QK):
        q = np.int64(blk[2 + i])
        out[i] = np.float32(q - 256 if q > 127 else q) * d


@njit(cache=True, inline="always")
def q4_0_dequantize_block(blk, out):  # blk [18] u8 -> out [32] f32
    d = f16_to_f32(np.uint16(blk[0]) | (np.uint16(blk[1]) << np.uint16(8)))
    for j in range(16):
        out[j] = np.float32(np.int64(blk[2 + j] & 0xF) - 8) * d
        out[j + 16] = np.float32(np.int64(blk[2 + j] >> 4) - 8) * d


_KV_NB = _KVALUES.copy()


@njit(cache=True, inline="always")
def _e8m0_half_nb(e):  # 2**(e - 128), exact in f32 (a subnormal for e < 2)
    return np.float32(2.0 ** (np.int64(e) - 128))


@njit(cache=True, inline="always")
def _nearest_code(v, d):  # the e2m1 code whose value d * kvalue is nearest v (the first on a tie, as argmin)
    best, best_err = 0, np.float32(np.inf)
    for c in range(16):
        err = abs(d * _KV_NB[c] - v)
        if err < best_err:
            best, best_err = c, err
    return best


@njit(cache=True, inline="always")
def mxfp4_quantize_block(x, out):  # x [32] f32 -> out [17] u8
    amax = np.float32(0.0)
    for i in range(QK):
        amax = max(amax, abs(x[i]))
    e = 0
    if amax > 0:
        e = min(max(np.int64(math.floor(math.log2(amax))) - 2 + 127, 0), 254)
    d = _e8m0_half_nb(e)
    out[0] = np.uint8(e)
    for j in range(16):
        out[1 + j] = np.uint8(_nearest_code(x[j], d) | (_nearest_code(x[j + 16], d) << 4))


@njit(cache=True, inline="always")
def mxfp4_dequantize_block(blk, out):  # blk [17] u8 -> out [32] f32
    d = _e8m0_half_nb(blk[0])
    for j in range(16):
        out[j] = d * _KV_NB[blk[1 + j] & 0xF]
        out[j + 16] = d * _KV_NB[blk[1 + j] >> 4]


def _quantize_rows(x, out):  # x [nb, 32] -> out [nb, bytes]; QUANTIZE_BLOCK bound per format (_numba_codec)
    for i in prange(x.shape[0]):
        QUANTIZE_BLOCK(x[i], out[i])  # noqa: F821 - a global of each twin


def _dequantize_rows(blk, out):  # blk [nb, bytes] -> out [nb, 32]; DEQUANTIZE_BLOCK bound per format
    for i in prange(blk.shape[0]):
        DEQUANTIZE_BLOCK(blk[i], out[i])  # noqa: F821 - a global of each twin


def _numba_codec(name: str, block_bytes: int, quantize_block, dequantize_block) -> Codec:
    """The Numba codec of a GGML block format: the row loops above, one twin per format (its own name and its
    block functions bound as globals, so Numba's disk cache keeps one entry per format instead of one
    closure whose entries the formats overwrite: before, q8_0, q4_0 and mxfp4 recompiled on every run)."""
    from ..cpu._jit import Kernel, twin

    quantize_rows = Kernel(twin(_quantize_rows, f"__{name}", QUANTIZE_BLOCK=quantize_block))  # serial below
    dequantize_rows = Kernel(twin(_dequantize_rows, f"__{name}", DEQUANTIZE_BLOCK=dequantize_block))  # PARALLEL_MIN_WORK

    def quantize(w: np.ndarray, fmt: Format) -> dict:
        x = w.reshape(-1, QK)
        out = np.empty((x.shape[0], block_bytes), np.uint8)
        quantize_rows(x.size, x, out)
        return {"blocks": out.reshape(*w.shape[:-1], -1)}

    def dequantize(arrays, fmt: Format, shape: tuple) -> np.ndarray:
        blk = np.ascontiguousarray(arrays["blocks"]).reshape(-1, block_bytes)
        out = np.empty((blk.shape[0], QK), np.float32)
        dequantize_rows(out.size, blk, out)
        return out.reshape(shape)

    return Codec(quantize, dequantize)


Q8_0 = Format(name="q8_0", kind="block", bits=8, group_size=QK, doc="GGML q8_0: blocks of 32, f16 scale",
              layout=_layout(34), scales=_block_scales, block=(QK, 34), cpu_decoder="q8_0", cuda_decoder="Q8_0Dec",
              kv_row="Q8_0Row", uqff_tag=0, ggml_type=8, int_form="block",
              codecs={"numpy": Codec(q8_0_quantize_ref, q8_0_dequantize_ref),
                      "numba": _numba_codec("q8_0", 34, q8_0_quantize_block, q8_0_dequantize_block)})
Q4_0 = Format(name="q4_0", kind="block", bits=4, group_size=QK, doc="GGML q4_0: blocks of 32, f16 scale, offset 8",
              layout=_layout(18), scales=_block_scales, block=(QK, 18), cpu_decoder="q4_0", cuda_decoder="Q4_0Dec",
              kv_row="Q4_0Row", uqff_tag=0, ggml_type=2, int_form="block",
              codecs={"numpy": Codec(q4_0_quantize_ref, q4_0_dequantize_ref),
                      "numba": _numba_codec("q4_0", 18, q4_0_quantize_block, q4_0_dequantize_block)})
MXFP4 = Format(name="mxfp4", kind="mx", bits=4, group_size=QK,
               doc="OCP MX fp4: blocks of 32 e2m1 codes, one e8m0 shared exponent (GGML MXFP4, gpt-oss experts)",
               layout=_layout(17), scales=_mxfp4_scales, block=(QK, 17), max_abs=6.0 * 2.0 ** 127,
               cpu_decoder="mxfp4", cuda_decoder="Mxfp4Dec", uqff_tag=0, ggml_type=39,
               codecs={"numpy": Codec(mxfp4_quantize_ref, mxfp4_dequantize_ref),
                       "numba": _numba_codec("mxfp4", 17, mxfp4_quantize_block, mxfp4_dequantize_block)})
FORMATS = (Q8_0, Q4_0, MXFP4)
