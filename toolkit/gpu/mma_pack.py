"""Expert codes repacked once, at upload, for the tensor-core GEMM (cuda_src/moe_gemm_mma.cu): affine int2/3/4, the
GGML blocks of 32 (q4_0, q4_1, q5_0, q5_1, q8_0, mxfp4) and the k-quants q2_K..q6_K (``KQUANTS``).

The stored layouts make a thread of the kernel read 8 codes at a time (affine ``qweight [E, N, K * bits / 8]``) or
bytes of 17-34-byte blocks, which no wide load can fetch. Repacked, each expert is cut into tiles of 64 rows x
64 k, and each tile into the 128 threads' shares in the order the kernel decodes them: thread t holds the 8-code
chunks t, t + 128, t + 256, t + 384 of the tile (chunk c: tile row c // 8, k (c % 8) * 8 ..), so the 32 codes a
thread decodes per k-tile are one 16-byte load (4-bit codes), one 8-byte load (int2), three aligned words (int3),
two 16-byte loads (q8_0) or a 16-byte and a 4-byte load (q5_0 / q5_1); a warp reads 512 contiguous bytes per
16-byte load. Within a thread's words the codes are ordered so that a pair of weights sits in one field of both
halves of a word, which one lop3 turns into an f16x2 (``_words`` says how, per width).
``mma_codes [E, N / 64, K / 64, 128 * 4 * bits / 8]``.

``halves`` (gate_up ``[E, 2I, K]``): tile R holds gate rows 32 R .. 32 R + 31 and up rows I + 32 R .., the rows a
block of the kernel needs to apply silu_and_mul in its epilogue. An affine group's f16 scale and bias become one
u32 word, ``mma_scale_bias`` (scale in the low half); a GGML block's scale d becomes ``mma_scales`` f16 (mxfp4:
``2^(e - 113)``, the codes' f16 form being ``e2m1 * 2^-14``), or with q4_1 / q5_1's minimum m, ``mma_scale_bias``
as the affine formats'. Both are in tile order too, ``[E, N / 64, K / group, 16, 4]``: a thread's 4 chunks are
rows r, r + 16, r + 32, r + 48 of its tile (r = thread // 8), so their values of a group are side by side, one
16-byte (or 8-byte) load per k-tile (``_tile_side``). Every weight decodes to the stored value
rounded to f16 once (``dequantize`` here is the NumPy statement of that). The packed QTensor keeps the format and
shape; its arrays are named ``mma_*`` so that nothing else mistakes them for the stored layout (the other kernels
refuse them, and the contract names why). Sizes: the same bytes, except mxfp4 (a 2-byte scale for its 1-byte
exponent: 18 bytes per 32 weights instead of 17).

A k-quant super-block (d, dmin f16; 4- to 8-bit factors sc, m per group of 16 or 32) becomes the codes of the packed
decoder that reads its code width (q2_K: int2's, q3_K: int3's with the 4 subtracted, q4_K: int4's, q5_K: q5_1's,
q6_K: int4's nibbles and a word of high 2-bit fields for every 16 codes, ``Q6_HIGH``, with the 32 subtracted) and one
f16 scale d * sc a group (``mma_scales``), or with q4_K / q5_K's minimum the word of scale and bias -dmin * m
(``mma_scale_bias``). Those products are exact in f32 and rounded to f16 here, once: a weight is then within
|q - off| half an ulp of its scale plus half an ulp of its bias of the stored value, before the kernel's rounding
(``dequantize`` states the packed value). Sizes: 4.0 / 5.0 / 6.0 / 7.0 bits a weight instead of 3.4375 / 4.5 / 5.5 /
6.5625. q2_K keeps its 2.625 bits: its 4-bit factors stay (``mma_factors``: a thread's 4 chunks' sc and m of a group
of 16 in one word, ``_factor_words``, the words of a super-block's 4 k-tiles side by side, ``_factor_order``) beside
a word (d, -dmin) a super-block row (``mma_super``), and the kernel makes the same f16 products per k-tile, by one
FMA with a bias -E * (d, -dmin) it makes once a super-block (so |d|, dmin <= ``Q2K_MAX_D``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..formats.base import array_module

TILE = 64  # rows and k per tile
THREADS = 128
KEYS = {"natural": "mma_codes", "halves": "mma_codes_halves"}
GGML_GROUP = 32
MXFP4_MAX_E = 128  # 2^(e - 113) must be a finite f16 (e > 128 would overflow; e < 89 rounds to 0, as its weights)


@dataclasses.dataclass(frozen=True)
class GgmlForm:
    """How a GGML block of 32 splits into codes (element order), scale d and the minimum m, and how it is decoded."""

    decoder: str  # the packed decoder struct of cuda_src/formats.cuh
    bits: int  # code bits (5: a nibble plus a fifth bit in its own plane)
    d: int | None  # byte offset of the f16 scale (None: mxfp4's e8m0 byte 0)
    m: int | None  # byte offset of the f16 minimum, or None
    qh: int | None  # byte offset of the u32 fifth bits, or None
    qs: int  # byte offset of the codes
    offset: int  # value = (q - offset) * d (+ m)
    value: Callable | None = None  # code -> value in units of d, when not (q - offset)


def _e2m1(q):
    from ..formats.ggml import E2M1

    return E2M1[q]


GGML = {
    "q4_0": GgmlForm("Q4_0PackedDec", 4, d=0, m=None, qh=None, qs=2, offset=8),
    "q4_1": GgmlForm("AffinePackedDec<4>", 4, d=0, m=2, qh=None, qs=4, offset=0),
    "q5_0": GgmlForm("Q5_0PackedDec", 5, d=0, m=None, qh=2, qs=6, offset=16),
    "q5_1": GgmlForm("Q5_1PackedDec", 5, d=0, m=2, qh=4, qs=8, offset=0),
    "q8_0": GgmlForm("Q8_0PackedDec", 8, d=0, m=None, qh=None, qs=2, offset=0),
    "mxfp4": GgmlForm("Mxfp4PackedDec", 4, d=None, m=None, qh=None, qs=1, offset=0, value=_e2m1),
}


@dataclasses.dataclass(frozen=True)
class KForm:
    """How a k-quant super-block of 256 is repacked: its codes in the packed decoder's order, each group's scale
    d * sc (and minimum: the bias -dmin * m) rounded to f16 (``mma_scales``, or ``mma_scale_bias`` with a minimum)."""

    decoder: str  # the packed decoder struct of cuda_src/formats.cuh
    group: int  # values per scale (16 or 32)
    off: int  # what the decoder subtracts from the code (q3_K: 4; the formats with a minimum take 0)
    factors: bool = False  # the side keeps the stored factors (``mma_factors``, ``mma_super``): the kernel multiplies


# q2_K keeps its 4-bit sc and m (``mma_factors``, a byte a group) and (d, -dmin) (``mma_super``, a word a super-block
# row): as two f16 a group of 16 they would make its 2.625 bits a weight 4.0; the kernel makes the products per k-tile
KQUANTS = {"q2_k": KForm("Q2_KPackedDec", 16, 0, factors=True), "q3_k": KForm("Q3_KPackedDec", 16, 4),
           "q4_k": KForm("AffinePackedDec<4>", 32, 0), "q5_k": KForm("Q5_1PackedDec", 32, 0),
           "q6_k": KForm("Q6_KPackedDec", 16, 32)}
SUPER = 256  # values of a k-quant super-block: q2_K's ``mma_super`` group
KQUANT_MAX_D = 65504.0 / 128  # |d| and dmin times a factor (|sc| <= 128: q6_K's int8) stay finite f16
Q2K_MAX_D = 65504.0 / 1024  # q2_K: the kernel's bias -1024 * (d, -dmin) stays finite f16 (formats.cuh Q2_KPackedDec)
RING_TILES = {  # cuda_src/formats.cuh: k-tiles of codes the kernel fetches ahead, per packed decoder
    "AffinePackedDec<2>": 6, "AffinePackedDec<3>": 6, "AffinePackedDec<4>": 3, "Q4_0PackedDec": 3,
    "Mxfp4PackedDec": 3, "Q8_0PackedDec": 2, "Q5_0PackedDec": 3, "Q5_1PackedDec": 3, "Q3_KPackedDec": 6,
    "Q6_KPackedDec": 3, "Q2_KPackedDec": 12}
CODE_BITS = {  # cuda_src/formats.cuh: bits a code a packed decoder reads (its TILE_BYTES = 64 x 64 of them)
    "AffinePackedDec<2>": 2, "AffinePackedDec<3>": 3, "AffinePackedDec<4>": 4, "Q4_0PackedDec": 4, "Mxfp4PackedDec": 4,
    "Q8_0PackedDec": 8, "Q5_0PackedDec": 5, "Q5_1PackedDec": 5, "Q3_KPackedDec": 3, "Q6_KPackedDec": 6,
    "Q2_KPackedDec": 2}

SIDE_BYTES = {  # cuda_src/formats.cuh SIDE and SUPER: bytes of a row's side a group (an f16 scale 2, a scale-bias
    # word 4; q2_K a factor byte) and of its super-block word (q2_K's (d, -dmin): 4), per packed decoder
    "AffinePackedDec<2>": (4, 0), "AffinePackedDec<3>": (4, 0), "AffinePackedDec<4>": (4, 0), "Q4_0PackedDec": (2, 0),
    "Mxfp4PackedDec": (2, 0), "Q8_0PackedDec": (2, 0), "Q5_0PackedDec": (2, 0), "Q5_1PackedDec": (4, 0),
    "Q3_KPackedDec": (2, 0), "Q6_KPackedDec": (2, 0), "Q2_KPackedDec": (1, 4)}


def tile_bytes(dec: str) -> int:
    """Bytes of one 64 x 64 tile of a packed decoder's codes (formats.cuh ``TILE_BYTES``)."""
    return TILE * TILE * CODE_BITS[dec] // 8


def side_ring(dec: str) -> int:
    """k-tiles of side words (scales, scale-bias words) the block_m 16 kernel fetches ahead into registers, as it does
    the codes (moe_gemm_mma.cu SR: 2, or 3 where the code ring is 3 tiles; q2_K none: its factors and super-block
    words are loaded once a super-block, the next one prefetched into L2)."""
    ring = RING_TILES[dec]
    return 1 if dec == KQUANTS["q2_k"].decoder else 2 if ring % 2 == 0 else ring


def decoder(fmt) -> str | None:
    """The packed decoder struct of ``fmt`` (cuda_src/formats.cuh), or None when its codes are not repacked."""
    if fmt.name in GGML:
        return GGML[fmt.name].decoder
    if fmt.name in KQUANTS:
        return KQUANTS[fmt.name].decoder
    if (fmt.cuda_decoder or "").startswith("AffineDec<") and fmt.bits in (2, 3, 4):
        return f"AffinePackedDec<{fmt.bits}>"
    return None


def code_bits(fmt) -> int:
    """Bits of one code in the packed layout."""
    return GGML[fmt.name].bits if fmt.name in GGML else fmt.bits


def _word_kind(fmt):
    """How a thread's words hold the codes (``_words``): the code width, or "e2m1" (mxfp4: ``E2M1``)."""
    return "e2m1" if fmt.name == "mxfp4" else code_bits(fmt)


def side_group(fmt) -> int | None:
    """Weights per value of the packed layout's scales (the kernel's ``group``); None: the format's own group."""
    return GGML_GROUP if fmt.name in GGML else KQUANTS[fmt.name].group if fmt.name in KQUANTS else fmt.group_size


def _has_min(fmt) -> bool:
    """Whether the packed side holds a minimum (bias) beside each scale: ``mma_scale_bias``, not ``mma_scales``."""
    if fmt.name in GGML:
        return GGML[fmt.name].m is not None
    if fmt.name in KQUANTS:
        return bool(_kspec(fmt).min)
    return True  # affine: scale and bias


def keeps_factors(fmt) -> bool:
    return fmt.name in KQUANTS and KQUANTS[fmt.name].factors


def _kspec(fmt):
    from ..formats.kquant import SPECS

    return SPECS[fmt.name]


def side_bits(fmt) -> float:
    """Bits per weight of the packed layout's scales and minimums (what one k-tile reads beside its codes)."""
    if keeps_factors(fmt):  # a byte (sc | m << 4) a group, a word (d, -dmin) a super-block
        return 8 / side_group(fmt) + 32 / SUPER
    if fmt.name in GGML or fmt.name in KQUANTS:
        return 16 * (1 + _has_min(fmt)) / side_group(fmt)
    return fmt.bits_per_weight((4096, 4096)) - fmt.bits


def packable(qt) -> bool:
    """A repacked format, [E, N, K] with N and K multiples of 64 and a power-of-two group, codes in the stored
    layout (mxfp4: every exponent <= 128, so its f16 scale is finite; k-quants: every |d| and dmin <= KQUANT_MAX_D,
    so d * sc and dmin * m are; q2_K <= Q2K_MAX_D)."""
    if decoder(qt.fmt) is None or len(qt.shape) != 3:
        return False
    E, N, K = qt.shape
    stored = _stored(qt.fmt)
    group = side_group(qt.fmt) or K
    if N % TILE or K % TILE or stored not in qt.arrays or group & (group - 1) or E * N * (K // group) >= 1 << 32:
        return False  # the kernel finds a tile's group by a shift and indexes the scales in 32 bits
    if qt.fmt.name == "mxfp4":
        return int(np.max(qt.arrays["blocks"].reshape(-1, 17)[:, 0])) <= MXFP4_MAX_E  # (np.max: a device array too)
    if qt.fmt.name in KQUANTS:
        spec = _kspec(qt.fmt)
        blk = qt.arrays["blocks"].reshape(-1, spec.bytes)
        bound = Q2K_MAX_D if keeps_factors(qt.fmt) else KQUANT_MAX_D
        return all(float(np.max(abs(_u16(blk, at).view(np.float16).astype(np.float32)))) <= bound
                   for at in spec.halves)  # NaN compares False: refused
    return True


def _stored(fmt) -> str:
    """The stored array whose codes are repacked."""
    return "blocks" if fmt.name in GGML or fmt.name in KQUANTS else "qweight"


def packing(qt) -> str | None:
    """'natural', 'halves', or None when the codes are in the stored layout."""
    return next((kind for kind, key in KEYS.items() if key in qt.arrays), None)


def _tile_rows(N: int, halves: bool) -> np.ndarray:
    """[N / 64, 64]: the rows of each tile."""
    r = np.arange(TILE)
    if not halves:
        return np.arange(N // TILE)[:, None] * TILE + r
    g = np.arange(N // TILE)[:, None] * (TILE // 2)
    return np.where(r < TILE // 2, g + r, N // 2 + g + r - TILE // 2)


def _index(N: int, K: int, halves: bool):
    """(row, 8-code column) of each thread's chunks: two [N / 64, K / 64, 128, 4] index arrays."""
    c = np.arange(THREADS)[:, None] + THREADS * np.arange(4)  # [128 threads, 4 chunks]
    rows, k8 = c // 8, c % 8  # tile row, chunk within the row's 64 k
    tr = np.broadcast_to(_tile_rows(N, halves)[:, rows][:, None], (N // TILE, K // TILE, THREADS, 4))
    kc = np.broadcast_to((np.arange(K // TILE)[:, None, None] * 8 + k8)[None], tr.shape)
    return tr, kc


def _tiles(xp, chunks, halves: bool):
    """chunks [E, N, K / 8, b] (b bytes or codes per 8 codes) -> [E, N / 64, K / 64, 128, 4, b] in the kernel's
    order."""
    _, N, K8, _ = chunks.shape
    tr, kc = _index(N, K8 * 8, halves)
    return chunks[:, xp.asarray(tr), xp.asarray(kc), :]


def _untile(packed, N: int, K: int, halves: bool, b: int) -> np.ndarray:
    """The inverse of ``_tiles``: [E, N / 64, K / 64, 128 * 4 * b] -> [E, N, K / 8, b]."""
    E = packed.shape[0]
    tr, kc = _index(N, K, halves)
    out = np.empty((E, N, K // 8, b), np.uint8)
    out[:, tr, kc, :] = np.asarray(packed).reshape(E, N // TILE, K // TILE, THREADS, 4, b)
    return out


PAIRS = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # 4-bit codes of a chunk in its word: pair p at nibbles p and p + 4


def _dense(xp, c, bits: int):
    """codes [..., n] (< 2**bits) -> bytes [..., n * bits / 8], LSB first."""
    per = 8 // bits
    c = c.astype(np.uint8).reshape(*c.shape[:-1], c.shape[-1] // per, per)
    out = c[..., 0].copy()
    for i in range(1, per):
        out |= c[..., i] << np.uint8(bits * i)
    return out


def _undense(b, bits: int) -> np.ndarray:
    """The inverse of ``_dense``."""
    per = 8 // bits
    c = np.stack([(b >> np.uint8(bits * i)) & np.uint8((1 << bits) - 1) for i in range(per)], axis=-1)
    return c.reshape(*b.shape[:-1], -1)


def _words(xp, t, bits: int | str):
    """Tiled codes [..., 128, 4, 8] -> each thread's bytes [..., 128 * 4 * bits / 8] in the words the decoder reads,
    ordered so that a pair of weights (2p, 2p + 1) of a chunk sits at the same bits of the two halves of a word (the
    word shifted by 8 for the upper pairs), which one lop3 puts under an f16 exponent (formats.cuh
    AffinePackedDec::q_f16):
      4 bits: a chunk's word holds its codes in the order 0 2 4 6 1 3 5 7 (pair p: nibbles p and p + 4);
      "e2m1" (mxfp4): a chunk's word too, each code's (exponent, mantissa) bits and sign apart (``E2M1``);
      2 bits: a word holds two chunks (j, j + 1): pair k = 4 (j % 2) + p at bits 2k and 16 + 2k;
      3 bits: three words (a thread's 12 bytes, aligned), five pairs whole in each, pair i = 4j + p < 15 of word
      i // 5 at bits ``THREE[i % 5]`` (0, 3, 6, 9, 12) and 16 above; pair 15 (chunk 3's last) in the words' top
      bits, its bit b at bit 15 (and 31) of word b (``_words3``);
      8 bits (q8_0): a tile is chunks 0-1 of every thread, then chunks 2-3 (two 16-byte loads, each coalesced);
      5 bits (q5_0 / q5_1): the low nibbles as 4 bits, then every thread's word of fifth bits, pair p of chunk j at
      bits ``PLANE[5][j][p]`` and 16 above."""
    lead, pairs = t.shape[:-3], xp.asarray(PAIRS)
    if bits == "e2m1":
        return _words_e2m1(xp, t)
    if bits == 8:
        return t.reshape(*lead, THREADS, 2, 2, 8).swapaxes(-4, -3).reshape(*lead, -1)
    if bits == 4:
        return _dense(xp, t[..., pairs], 4).reshape(*lead, -1)
    if bits == 2:
        w = t.reshape(*lead, THREADS, 2, 2, 8)  # [.., thread, word, chunk in word, code]
        lo = w[..., 0::2].reshape(*lead, THREADS, 2, 8)
        hi = w[..., 1::2].reshape(*lead, THREADS, 2, 8)
        return _dense(xp, xp.concatenate([lo, hi], axis=-1), 2).reshape(*lead, -1)
    if bits == 3:
        return _words3(xp, t)
    if bits == 5:
        lo = _dense(xp, (t & np.uint8(15))[..., pairs], 4).reshape(*lead, -1)
        return xp.concatenate([lo, _plane(xp, t >> np.uint8(4), 5).reshape(*lead, -1)], axis=-1)
    if bits == 6:
        lo = _dense(xp, (t & np.uint8(15))[..., pairs], 4).reshape(*lead, -1)
        return xp.concatenate([lo, _high2(xp, t >> np.uint8(4))], axis=-1)
    raise ValueError(f"mma_pack: no word order for {bits}-bit codes")


# int3: the bit of each of a word's five whole pairs (and 16 above). Pairs at 0, 3 and 6 are each one lop3 from
# the word (under the f16 exponents of 1024, 128 and 16), those at 9 and 12 one lop3 from the word shifted by 9
# (one shift a word, for two pairs); pair 15's three bits, at bit 15 of the three words, are gathered at bits 6-8
# by three lop3 and two shifts (formats.cuh AffinePackedDec<3>::q_f16). A pair costs one lop3 where the layout of
# the low 2 bits as int2's and the third bits in a word of their own cost two
THREE = np.array([0, 3, 6, 9, 12], np.uint32)
THREE_AT = THREE[:, None] + np.array([0, 16], np.uint32)  # [5 pairs, 2 halves]: the bit of each whole pair's codes


def _words3(xp, t):
    """3-bit codes [..., 128, 4, 8] -> each thread's three words [..., 128 * 12 bytes] (``THREE``)."""
    lead = t.shape[:-3]
    c = t.reshape(*lead, THREADS, 16, 2)  # pair 4j + p: codes 2p, 2p + 1 of chunk j
    whole = c[..., :15, :].reshape(*lead, THREADS, 3, 5, 2)
    top = c[..., 15, :]  # [.., 128, 2]
    words = xp.zeros((*lead, THREADS, 3), np.uint32)
    for f, at in enumerate(THREE.tolist()):  # disjoint fields: or them in, a slot at a time (no wide temporaries)
        words |= whole[..., f, 0].astype(np.uint32) << np.uint32(at)
        words |= whole[..., f, 1].astype(np.uint32) << np.uint32(16 + at)
    for b in range(3):  # bit b of pair 15 at bit 15 (and 31) of word b
        words[..., b] |= (((top[..., 0] >> np.uint8(b)) & np.uint8(1)).astype(np.uint32) << np.uint32(15)) | \
                         (((top[..., 1] >> np.uint8(b)) & np.uint8(1)).astype(np.uint32) << np.uint32(31))
    return xp.ascontiguousarray(words).view(np.uint8).reshape(*lead, -1)


def _unwords3(b) -> np.ndarray:
    """The inverse of ``_words3`` (NumPy): [..., 128 * 12] bytes -> codes [..., 128, 4, 8]."""
    lead = b.shape[:-1]
    w = np.ascontiguousarray(b).view("<u4").reshape(*lead, THREADS, 3).astype(np.uint32)
    c = np.empty((*lead, THREADS, 16, 2), np.uint8)
    c[..., :15, :] = ((w[..., :, None, None] >> THREE_AT) & np.uint32(7)).reshape(*lead, THREADS, 15, 2)
    top = (w[..., :, None] >> np.array([15, 31], np.uint32)) & np.uint32(1)  # [.., 128, 3 words, 2 halves]
    c[..., 15, :] = (top << np.arange(3, dtype=np.uint32)[:, None]).sum(axis=-2)
    return c.reshape(*lead, THREADS, 4, 8)


# mxfp4: a chunk's word holds its 8 e2m1 codes as int4's does, a pair p (codes 2p, 2p + 1) in both halves, but each
# code's bits split: its (exponent, mantissa) bits 0-2 at bit E2M1[0][p] and its sign at E2M1[1][p]. The decoder
# moves them to bits 9-11 and 15 (formats.cuh Mxfp4PackedDec::e2m1_f16): pairs 0 and 2 (sign 6 above the rest) by one
# shift and one lop3 each, pair 1 by two shifts and two lop3, pair 3 (its sign in place) by one shift and two lop3:
# 11 instructions a word where nibbles p and p + 4 took 15 (found by trying every placement of the 4 pairs)
E2M1 = ((0, 3, 8, 11), (6, 7, 14, 15))
# [2 parts, 4 pairs, 2 halves]: the bit of each pair's (exponent, mantissa) field and of its sign
E2M1_AT = np.array(E2M1, np.uint32)[:, :, None] + np.array([0, 16], np.uint32)


def _words_e2m1(xp, t):
    """mxfp4 codes [..., 128, 4, 8] -> each thread's 4 words [..., 128 * 16 bytes] (``E2M1``)."""
    lead = t.shape[:-3]
    c, at = t.reshape(*lead, THREADS, 4, 4, 2), E2M1_AT  # [.., thread, chunk, pair, half]
    words = xp.zeros((*lead, THREADS, 4), np.uint32)
    for p in range(4):
        for h in range(2):
            q = c[..., p, h]
            words |= (q & np.uint8(7)).astype(np.uint32) << np.uint32(at[0, p, h])
            words |= (q >> np.uint8(3)).astype(np.uint32) << np.uint32(at[1, p, h])
    return xp.ascontiguousarray(words).view(np.uint8).reshape(*lead, -1)


def _unwords_e2m1(b) -> np.ndarray:
    """The inverse of ``_words_e2m1`` (NumPy): [..., 128 * 16] bytes -> codes [..., 128, 4, 8]."""
    lead = b.shape[:-1]
    w, at = np.ascontiguousarray(b).view("<u4").reshape(*lead, THREADS, 4, 1, 1).astype(np.uint32), E2M1_AT
    c = ((w >> at[0]) & np.uint32(7)) | (((w >> at[1]) & np.uint32(1)) << np.uint32(3))  # [.., 128, 4, 4, 2]
    return c.astype(np.uint8).reshape(*lead, THREADS, 4, 8)


# The bit of pair p of chunk j (codes 2p, 2p + 1: the low and high halves) in a thread's plane word, by width, so
# that one shift of the word per group of pairs puts each pair's bits where its f16 field wants them
# (formats.cuh): q5's fifth bit goes to 4 (p % 2) + 4, so the two pairs of a (chunk, word half) g = 2j + p // 2 sit
# at 4 (p % 2) + 4 + s_g, s = -4 .. -1, 4 .. 7: one shift a g
PLANE = {5: [[4 * (p % 2) + 4 + (g - 4 if g < 4 else g) for p in range(4) for g in [2 * j + p // 2]] for j in range(4)]}


# q6_K's high 2 bits: a thread's two words, word w for chunks 2w and 2w + 1; pair p of chunk c = j % 2 (codes 2p,
# 2p + 1) at bits Q6_HIGH[c][p] and 16 above, so that one shift of the word moves pairs p and p + 1 (p even) to bits
# 4 and 8 (and 20, 24), above their nibbles (formats.cuh Q6_KPackedDec): positions 0, 4, 2, 6 and 8, 12, 10, 14
Q6_HIGH = [[8 * c + 2 * (p >= 2) + 4 * (p % 2) for p in range(4)] for c in range(2)]


def _high2_shifts(xp):
    """[2 chunks, 4 pairs, 2 halves]: the bit of each 2-bit field in its word."""
    return xp.asarray(np.array(Q6_HIGH, np.uint32)[:, :, None] + np.array([0, 16], np.uint32))


def _high2(xp, hb):
    """2-bit fields [..., 128, 4, 8] -> each thread's two words [..., 128 * 8 bytes] (Q6_HIGH)."""
    lead = hb.shape[:-3]
    h = hb.reshape(*lead, THREADS, 2, 2, 4, 2).astype(np.uint32)  # [.., thread, word, chunk c, pair, half]
    words = (h << _high2_shifts(xp)).sum(axis=(-3, -2, -1), dtype=np.uint32)  # disjoint bits: the sum is the or
    return xp.ascontiguousarray(words).view(np.uint8).reshape(*lead, -1)


def _unhigh2(b) -> np.ndarray:
    """The inverse of ``_high2`` (NumPy): [..., 128 * 8] bytes -> 2-bit fields [..., 128, 4, 8]."""
    lead = b.shape[:-1]
    w = np.ascontiguousarray(b).view(np.uint32).reshape(*lead, THREADS, 2, 1, 1, 1)
    return ((w >> _high2_shifts(np)) & np.uint32(3)).astype(np.uint8).reshape(*lead, THREADS, 4, 8)


def _plane_order(bits: int) -> np.ndarray:
    """[16]: the pair (4 j + p) whose bit is bit b of a plane word's half."""
    pos = np.array(PLANE[bits]).reshape(16)
    assert sorted(pos.tolist()) == list(range(16))
    return np.argsort(pos)


def _plane(xp, h, bits: int):
    """One bit of each code [..., 128, 4, 8] -> a word a thread [..., 128, 4 bytes]: pair p of chunk j (codes 2p,
    2p + 1) at bits PLANE[bits][j][p] and 16 above."""
    lead, order = h.shape[:-3], xp.asarray(_plane_order(bits))
    low = h[..., 0::2].reshape(*lead, THREADS, 16)[..., order]
    high = h[..., 1::2].reshape(*lead, THREADS, 16)[..., order]
    return _dense(xp, xp.concatenate([low, high], axis=-1), 1)


def _unplane(b, bits: int) -> np.ndarray:
    """The inverse of ``_plane`` (NumPy): [..., 128, 4] bytes -> bits [..., 128, 4, 8]."""
    lead, inv = b.shape[:-2], np.argsort(_plane_order(bits))
    plane = _undense(b, 1)  # [.., 128, 32]
    h = np.empty((*lead, THREADS, 4, 8), np.uint8)
    h[..., 0::2] = plane[..., :16][..., inv].reshape(*lead, THREADS, 4, 4)
    h[..., 1::2] = plane[..., 16:][..., inv].reshape(*lead, THREADS, 4, 4)
    return h


def _unwords(b, bits: int | str) -> np.ndarray:
    """The inverse of ``_words`` (NumPy): [..., tile bytes] -> codes [..., 128, 4, 8]."""
    lead = b.shape[:-1]
    if bits == "e2m1":
        return _unwords_e2m1(b)
    if bits == 8:
        return b.reshape(*lead, 2, THREADS, 2, 8).swapaxes(-4, -3).reshape(*lead, THREADS, 4, 8)
    inv = np.argsort(PAIRS)
    if bits == 3:
        return _unwords3(b)
    if bits == 4:
        return _undense(b.reshape(*lead, THREADS, 4, 4), 4)[..., inv]
    if bits == 2:
        c = _undense(b.reshape(*lead, THREADS, 2, 4), 2)  # [.., thread, word, 16]
        w = np.empty((*lead, THREADS, 2, 2, 8), np.uint8)
        w[..., 0::2] = c[..., :8].reshape(*lead, THREADS, 2, 2, 4)
        w[..., 1::2] = c[..., 8:].reshape(*lead, THREADS, 2, 2, 4)
        return w.reshape(*lead, THREADS, 4, 8)
    lo = _undense(b[..., :THREADS * 16].reshape(*lead, THREADS, 4, 4), 4)[..., inv]
    if bits == 6:
        return lo | (_unhigh2(b[..., THREADS * 16:]) << np.uint8(4))
    return lo | (_unplane(b[..., THREADS * 16:].reshape(*lead, THREADS, 4), 5) << np.uint8(4))


def _u16(blk, off: int):
    return blk[..., off].astype(np.uint16) | (blk[..., off + 1].astype(np.uint16) << np.uint16(8))


def _blocks(xp, qt, experts=slice(None)):
    """A GGML QTensor's blocks (of ``experts``): [e, N, K / 32, block bytes]."""
    _, N, K = qt.shape
    return xp.asarray(qt.arrays["blocks"][experts]).reshape(-1, N, K // 32, qt.fmt.block[1])


def ggml_codes_of(xp, qt, experts=slice(None)):
    """A GGML QTensor's codes (of ``experts``), u8 [e, N, K] in element order."""
    form, (_, N, K), blk = GGML[qt.fmt.name], qt.shape, _blocks(xp, qt, experts)
    if form.bits == 8:
        return blk[..., form.qs:form.qs + 32].reshape(-1, N, K)
    qs = blk[..., form.qs:form.qs + 16]
    codes = xp.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)  # element j < 16: low nibble of j
    if form.qh is not None:
        qh = sum(blk[..., form.qh + i].astype(np.uint32) << np.uint32(8 * i) for i in range(4))  # [e, N, blocks]
        hi = (qh[..., None] >> xp.arange(32, dtype=np.uint32)) & np.uint32(1)
        codes = codes | (hi.astype(np.uint8) << np.uint8(4))
    return codes.reshape(-1, N, K)


def ggml_scales(xp, qt):
    """A GGML QTensor's block scales d, f16 [E, N, K / 32] (mxfp4: the e8m0 exponent as the f16 2^(e - 113)), and
    its minimums m (q4_1, q5_1) or None."""
    form, blk = GGML[qt.fmt.name], _blocks(xp, qt)
    if form.d is None:
        d = xp.ldexp(xp.ones(blk.shape[:-1], np.float32), blk[..., 0].astype(np.int32) - 113).astype(np.float16)
    else:
        d = _u16(blk, form.d).view(np.float16)
    return d, None if form.m is None else _u16(blk, form.m).view(np.float16)


def _kproducts(d, sc, dmin, m):
    """The scales d * sc and, with a minimum, the biases -dmin * m (f16 d, dmin [nb, 1 or G]; factors [nb, G]),
    each rounded to f16 once: the products are exact in f32 (an f16 times an 8-bit factor)."""
    half = lambda h: h.view(np.float16).astype(np.float32)  # noqa: E731
    s = (half(d) * sc.astype(np.float32)).astype(np.float16)
    return s, None if m is None else (-(half(dmin) * m.astype(np.float32))).astype(np.float16)


def kquant_parts(xp, qt, experts=slice(None)):
    """A k-quant QTensor (of ``experts``) taken apart for the packed decoder: codes u8 [e, N, K] in element order,
    and its side arrays {name: [e, N, G]} in element order: ``mma_scales`` d * sc (f16), or ``mma_scale_bias``
    with -dmin * m, rounded to f16 once (``_kproducts``); q2_K its factors as stored, ``mma_factors`` u8
    sc | m << 4 a group, and ``mma_super`` u32 (d, -dmin) a super-block (the kernel makes the products)."""
    from ..formats.kquant import fields

    _, N, K = qt.shape
    f = fields(qt.fmt.name, xp.asarray(qt.arrays["blocks"][experts]))
    G = K // KQUANTS[qt.fmt.name].group
    if keeps_factors(qt.fmt):
        factors = (f.sc.astype(np.uint8) | (f.m.astype(np.uint8) << np.uint8(4))).reshape(-1, N, G)
        dd = f.d.astype(np.uint32) | ((f.dmin ^ np.uint16(0x8000)).astype(np.uint32) << np.uint32(16))
        return f.codes.reshape(-1, N, K), {"mma_factors": factors, "mma_super": dd.reshape(-1, N, K // SUPER)}
    s, b = _kproducts(f.d[:, None], f.sc, None if f.dmin is None else f.dmin[:, None], f.m)
    side = {"mma_scales": s} if b is None else {"mma_scale_bias": _scale_bias(xp, s, b)}
    return f.codes.reshape(-1, N, K), {k: v.reshape(-1, N, G) for k, v in side.items()}


def _affine_codes(xp, qt, experts=slice(None)):
    """Affine int2 / int3 / int4 ``qweight`` (of ``experts``) -> codes u8 [e, N, K] (8 codes in ``bits`` bytes, LSB
    first: one 32-bit integer a chunk)."""
    _, N, K = qt.shape
    b = qt.fmt.bits
    q = xp.asarray(qt.arrays["qweight"][experts]).reshape(-1, N, K // 8, b).astype(np.uint32)
    v = sum(q[..., i] << np.uint32(8 * i) for i in range(b))  # [e, N, K / 8]
    codes = xp.stack([(v >> np.uint32(b * i)) & np.uint32((1 << b) - 1) for i in range(8)], axis=-1)
    return codes.astype(np.uint8).reshape(-1, N, K)


def _affine_bytes(codes, b: int) -> np.ndarray:
    """The inverse of ``_affine_codes`` (NumPy): codes [..., K] -> the stored bytes [..., K * b / 8]."""
    c = codes.reshape(*codes.shape[:-1], -1, 8).astype(np.uint32)
    v = sum(c[..., i] << np.uint32(b * i) for i in range(8))
    return np.stack([(v >> np.uint32(8 * i)) & np.uint32(255) for i in range(b)], axis=-1).astype(np.uint8).reshape(
        *codes.shape[:-1], -1)


def pack(qt, halves: bool = False):
    """The QTensor with its codes in the kernel's tile order (NumPy or CuPy arrays). ValueError if not packable."""
    if not packable(qt):
        raise ValueError(f"mma_pack: {qt.fmt.spec} {tuple(qt.shape)} is not affine int2/3/4, a GGML block of 32 "
                         f"(mxfp4: exponents <= {MXFP4_MAX_E}) or q2_K..q6_K (|d|, dmin <= {KQUANT_MAX_D:.0f}; "
                         f"q2_K {Q2K_MAX_D:.0f}) with N, K multiples of 64")
    E, N, K = qt.shape
    key = KEYS["halves" if halves else "natural"]
    xp = array_module(qt.arrays[_stored(qt.fmt)])
    bits = _word_kind(qt.fmt)
    ggml, kquant = qt.fmt.name in GGML, qt.fmt.name in KQUANTS
    out = xp.empty(packed_shape(qt), np.uint8)
    ks = []  # k-quants: each expert's side arrays {name: [1, N, G]}
    for e in range(E):  # an expert at a time: the transient codes are one expert's (Mixtral's gate_up: 117 MB)
        one = slice(e, e + 1)
        if kquant:
            codes, side = kquant_parts(xp, qt, one)
            ks.append(side)
        else:
            codes = ggml_codes_of(xp, qt, one) if ggml else _affine_codes(xp, qt, one)
        t = _words(xp, _tiles(xp, codes.reshape(1, N, K // 8, 8), halves), bits)  # tiled [1, R, T, 128, 4, 8]
        out[e] = t.reshape(N // TILE, K // TILE, -1)
    if kquant:
        side = {k: xp.concatenate([p[k] for p in ks]) for k in ks[0]}
    elif ggml:
        d, m = ggml_scales(xp, qt)
        side = {"mma_scales": d} if m is None else {"mma_scale_bias": _scale_bias(xp, d, m)}
    else:
        side = {"mma_scale_bias": _scale_bias(xp, qt.arrays["scales"], qt.arrays["biases"])}
    side = {k: _tile_side(xp, v, halves) for k, v in side.items()}
    if "mma_factors" in side:
        side["mma_factors"] = _factor_order(xp, _factor_words(xp, side["mma_factors"]))
    return dataclasses.replace(qt, arrays={key: out, **side})


def _factor_words(xp, t):
    """q2_K's factor bytes in tile order [..., 4] (byte j: sc | m << 4 of the thread's chunk j) -> the word the kernel
    reads, as bytes: chunk j's sc at bits 4j, its m at 16 + 4j, so that one lop3 puts a chunk's pair under the f16
    exponent of 2^(10 - 4 (j % 2)) (chunks 2, 3 after a shift by 8: formats.cuh Q2_KPackedDec::side_word)."""
    b = t.astype(np.uint32)
    sh = xp.asarray(4 * np.arange(4, dtype=np.uint32))
    w = ((b & np.uint32(15)) << sh).sum(axis=-1, dtype=np.uint32) | ((b >> np.uint32(4)) << (sh + np.uint32(16))).sum(
        axis=-1, dtype=np.uint32)
    return xp.ascontiguousarray(w).view(np.uint8).reshape(t.shape)


def _factor_order(xp, t):
    """q2_K's factor words in tile order [E, N / 64, G, 16, 4] (G = K / 16: group 4 kt + q of k-tile kt is the one of
    the threads with (thread % 8) / 2 = q) -> [E, N / 64, K / 256, 4 (q), 16, 4 (the k-tile in its super-block),
    4]: a thread's words of a super-block's 4 k-tiles side by side, one 16-byte load (moe_gemm_mma.cu)."""
    E, R, G = t.shape[:3]
    return xp.ascontiguousarray(t.reshape(E, R, G // 16, 4, 4, 16, 4).transpose(0, 1, 2, 4, 5, 3, 6))


def _factor_unorder(t) -> np.ndarray:
    """The inverse of ``_factor_order`` (NumPy)."""
    t = np.asarray(t)
    E, R, S = t.shape[:3]
    return np.ascontiguousarray(t.transpose(0, 1, 2, 5, 3, 4, 6)).reshape(E, R, S * 16, 16, 4)


def _factor_bytes(t) -> np.ndarray:
    """The inverse of ``_factor_words`` (NumPy)."""
    w = np.ascontiguousarray(t).view(np.uint32)  # [..., 1]
    sh = 4 * np.arange(4, dtype=np.uint32)
    return (((w >> sh) & np.uint32(15)) | (((w >> (sh + np.uint32(16))) & np.uint32(15)) << np.uint32(4))).astype(np.uint8)


def _side_rows(N: int, halves: bool) -> np.ndarray:
    """[N / 64, 16, 4]: the weight row of value (r, j) of a tile's side: chunk j of the threads with r = thread // 8,
    tile row r + 16 j."""
    return _tile_rows(N, halves).reshape(N // TILE, 4, 16).swapaxes(1, 2)


def _tile_side(xp, a, halves: bool):
    """Per-group values [E, N, G] -> the kernel's tile order [E, N / 64, G, 16, 4]."""
    rows = xp.asarray(_side_rows(a.shape[1], halves))
    return xp.ascontiguousarray(a[:, rows].transpose(0, 1, 4, 2, 3))


def _untile_side(a, halves: bool) -> np.ndarray:
    """The inverse of ``_tile_side`` (NumPy): [E, N / 64, G, 16, 4] -> [E, N, G]."""
    a = np.asarray(a)
    E, R, G = a.shape[:3]
    out = np.empty((E, R * TILE, G), a.dtype)
    out[:, _side_rows(R * TILE, halves)] = a.transpose(0, 1, 3, 4, 2)
    return out


def _scale_bias(xp, s, b):
    """f16 scales and biases [..., G] -> one u32 word per group, the scale in the low half (the kernel's one load)."""
    lo = xp.ascontiguousarray(xp.asarray(s).astype(np.float16)).view(np.uint16).astype(np.uint32)
    hi = xp.ascontiguousarray(xp.asarray(b).astype(np.float16)).view(np.uint16).astype(np.uint32)
    return xp.ascontiguousarray(lo | (hi << np.uint32(16)))


def _split_scale_bias(v):
    """The inverse of ``_scale_bias`` (NumPy): (scales f16, biases f16)."""
    v = np.asarray(v)
    half = lambda x: x.astype(np.uint16).view(np.float16)  # noqa: E731
    return half(v & np.uint32(0xFFFF)), half(v >> np.uint32(16))


def _codes(qt) -> np.ndarray:
    """A packed QTensor's codes back in element order, u8 [E, N, K] (NumPy)."""
    kind, (E, N, K), bits = packing(qt), qt.shape, _word_kind(qt.fmt)
    t = np.asarray(qt.arrays[KEYS[kind]]).reshape(E, N // TILE, K // TILE, -1)
    return _untile(_unwords(t, bits).reshape(E, N // TILE, K // TILE, -1), N, K, kind == "halves", 8).reshape(E, N, K)


def unpack(qt):
    """Affine codes: the stored layout back (tests: the packing moves codes, never changes one)."""
    kind = packing(qt)
    E, N, K = qt.shape
    b = qt.fmt.bits
    qweight = _affine_bytes(_codes(qt), b)
    scales, biases = _split_scale_bias(_untile_side(qt.arrays["mma_scale_bias"], kind == "halves"))
    return dataclasses.replace(qt, arrays={"qweight": qweight, "scales": scales, "biases": biases})


def ggml_codes(qt) -> np.ndarray:
    """A packed GGML QTensor's codes back in element order, u8 [E, N, K] (NumPy)."""
    return _codes(qt)


def side_values(qt):
    """A packed GGML or k-quant QTensor's scale and bias (or minimum) of each group as the decoder applies them, f16
    [E, N, K / group] (NumPy), the bias None where there is none; q2_K's made from its factors and super-block
    words as the kernel makes them."""
    halves = packing(qt) == "halves"
    if "mma_scales" in qt.arrays:
        return _untile_side(qt.arrays["mma_scales"], halves), None
    if "mma_scale_bias" in qt.arrays:
        return _split_scale_bias(_untile_side(qt.arrays["mma_scale_bias"], halves))
    f = _untile_side(_factor_bytes(_factor_unorder(qt.arrays["mma_factors"])), halves)  # [E, N, K / 16]
    dd = np.repeat(_untile_side(qt.arrays["mma_super"], halves), SUPER // side_group(qt.fmt), axis=-1)
    return _kproducts((dd & np.uint32(0xFFFF)).astype(np.uint16), f & np.uint8(15), (dd >> np.uint32(16)).astype(
        np.uint16) ^ np.uint16(0x8000), f >> np.uint8(4))


def dequantize(qt) -> np.ndarray:
    """What the packed decoders of the GGML and k-quant formats compute, in NumPy, before the kernel's one rounding
    to f16: f32 [E, N, K], each weight (q - offset) * d (+ m); mxfp4: e2m1(q) * 2^-14 * d = e2m1(q) * 2^(e - 127);
    k-quants: (q - off) * s (+ b), s and b the f16 scale and bias of its group."""
    q = ggml_codes(qt)
    group = side_group(qt.fmt)
    d, m = side_values(qt)
    d = np.repeat(np.asarray(d).astype(np.float32), group, axis=-1)  # [E, N, K]
    form = GGML.get(qt.fmt.name)
    if form is not None and form.value is not None:
        return form.value(q) * d * np.float32(2.0 ** -14)
    q = q.view(np.int8) if code_bits(qt.fmt) == 8 else q  # q8_0's codes are signed
    v = (q.astype(np.float32) - np.float32(form.offset if form else KQUANTS[qt.fmt.name].off)) * d
    if m is not None:
        v = v + np.repeat(np.asarray(m).astype(np.float32), group, axis=-1)
    return v


def array_specs(qt) -> dict:
    """name -> (dtype, shape) of a packed QTensor's arrays, in the order the kernels take them: codes, then scales
    (and biases)."""
    E, N, K = qt.shape
    kind = packing(qt)
    specs = {KEYS[kind]: (np.dtype(np.uint8), packed_shape(qt))}
    side = (E, N // TILE, K // side_group(qt.fmt), 16, 4)
    if keeps_factors(qt.fmt):  # its factors a group (a super-block's 4 k-tiles side by side), and (d, -dmin) a
        # super-block
        specs["mma_factors"] = (np.dtype(np.uint8), (E, N // TILE, K // SUPER, 4, 16, 4, 4))
        specs["mma_super"] = (np.dtype(np.uint32), (E, N // TILE, K // SUPER, 16, 4))
    elif not _has_min(qt.fmt):
        specs["mma_scales"] = (np.dtype(np.float16), side)
    else:  # affine, q4_1, q5_1, q4_K, q5_K: scale and bias (min) as one word
        specs["mma_scale_bias"] = (np.dtype(np.uint32), side)
    return specs


def kernel_arrays(qt) -> list:
    """The arrays in the order the kernels take them: codes (stored or packed), then scales, biases."""
    if packing(qt) is None:
        return [qt.arrays[n] for n in qt.fmt.arrays(qt.shape)]
    return [qt.arrays[n] for n in array_specs(qt)]


def packed_shape(qt) -> tuple:
    E, N, K = qt.shape
    return (E, N // TILE, K // TILE, THREADS * 4 * code_bits(qt.fmt))
