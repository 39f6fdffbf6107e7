"""igemm_pack: a weight's integer codes in the layout the integer GEMM reads (once per weight), and the
per-width code decoders the kernel template is compiled with.

Shapes: ``E`` experts, ``N`` output rows, ``K`` inputs, ``B = K / 32`` blocks, ``NT = ceil(N / 32) * 2``
row vectors of 16 rows (padded to pairs: the kernel's tile is 2 vectors), ``GS`` scale groups, ``G``
offset groups.

The integer form of a format comes from the spec (``toolkit/ref/igemm.py::int_weight``): unsigned codes
``c < 2**bits`` (8-bit codes biased by +128), an integer offset, f32 scales ``S`` and offsets ``Z``.
Layout (``Packed``):
  ``codes`` u8 [E, NT, B * 64 * bits]: for row vector ``t`` (rows 16t .. 16t + 15) and block ``b``,
      ``64 * bits`` bytes from which ``unpack(row, b * 64 * bits, q)`` makes quad vector ``q`` (0..7): lane
      ``l`` holds the 4 codes of row 16t + l at k = 32b + 4q .. 32b + 4q + 3, one per byte:
        8 bits: 8 vectors, vector q as is;
        4 bits: 4 vectors, vector v: low nibbles quad 2v, high nibbles quad 2v + 1;
        2 bits: 2 vectors, vector v: bits 2i..2i+1 of each byte quad 4v + i;
        3 bits: the 2-bit planes of the low 2 bits (128 bytes) then one 1-bit plane of the high bit
                (64 bytes: bit q of each byte belongs to quad q).
  ``S`` f32 [E, NT, GS * 16]: lane-ordered scales, group-major; ``Z`` f32 [E, NT, G * 16] (affine; zeros [E, NT, 16] otherwise).
Padded rows have code 0 and scale 0. Repacking is a permutation of the codes (plus f16 -> f32 scales): the
copy has about the size of the stored weight (q4_0: 5 bits a weight; int4-g128: 4.5; q8_0 / int8: 9).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..formats.packing import unpack_numba
from ..ref.igemm import QK, int_weight
from .igemm_simd import iv_and, iv_load, iv_or, iv_shl, iv_shr

ROWS = 32  # rows per kernel tile (2 vectors of 16)
PACK_ROWS = 2048  # rows repacked at a time (bounds the temporary int copies)


@dataclass
class Packed:
    codes: np.ndarray  # u8 [E, NT, B * 64 * bits]
    S: np.ndarray  # f32 [E, NT, GS * 16]
    Z: np.ndarray  # f32 [E, NT, G * 16] or [1, 1, 16] zeros
    bits: int  # code width: 8, 4, 3, 2
    offset: int  # o: the integer added to every code
    bpg: int  # blocks per scale group
    bpz: int  # blocks per offset group (0: no offsets)
    N: int
    K: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.S.nbytes + (self.Z.nbytes if self.bpz else 0)


def code_bits(fmt) -> int:
    return 8 if fmt.bits == 8 else fmt.bits


@njit(cache=True, parallel=True)
def _pack_rows(c, bits, out):
    """c u8 [n, K] natural-order codes (n a multiple of 16) -> out u8 [n / 16, B * 64 * bits] in the layout
    above: code k = 32b + 4q + j of row 16t + l belongs to byte 4l + j of quad vector q of block b. Each
    output byte is written once, in order (per bits: which quads share a byte and at which shift)."""
    B = c.shape[1] // QK
    per = 8 // bits if bits != 3 else 4  # quads sharing a byte (3 bits: the 2-bit planes; the high bits apart)
    shift = 8 // per
    for t in prange(c.shape[0] // 16):
        o = out[t]
        at = 0
        for b in range(B):
            for v in range(8 // per):  # byte vectors of the block (3 bits: the two 2-bit planes first)
                for lane in range(16):
                    row = c[16 * t + lane]
                    for j in range(4):
                        acc = 0
                        for i in range(per):
                            acc |= (np.int32(row[QK * b + 4 * (per * v + i) + j]) & 3 if bits == 3 else
                                    np.int32(row[QK * b + 4 * (per * v + i) + j])) << (shift * i)
                        o[at] = np.uint8(acc)
                        at += 1
            if bits == 3:  # the 1-bit plane: bit q of byte 4l + j is the high bit of quad q
                for lane in range(16):
                    row = c[16 * t + lane]
                    for j in range(4):
                        acc = 0
                        for q in range(8):
                            acc |= ((np.int32(row[QK * b + 4 * q + j]) >> 2) & 1) << q
                        o[at] = np.uint8(acc)
                        at += 1


def _pack_codes(c: np.ndarray, bits: int) -> np.ndarray:
    """c u8 [NT * 16, K] (row-padded) -> [NT, B * 64 * bits]."""
    if bits not in (8, 4, 3, 2):
        raise NotImplementedError(f"igemm: no packing for {bits}-bit codes")
    out = np.empty((c.shape[0] // 16, c.shape[1] // QK * 64 * bits), np.uint8)
    _pack_rows(np.ascontiguousarray(c), bits, out)
    return out


def _lanes(a: np.ndarray, NT: int) -> np.ndarray:
    """f32 [n, G] per-row values -> [NT, G * 16], lane-ordered, zero-padded rows."""
    n, G = a.shape
    p = np.zeros((NT * 16, G), np.float32)
    p[:n] = a
    return np.ascontiguousarray(p.reshape(NT, 16, G).transpose(0, 2, 1)).reshape(NT, G * 16)


def _int_rows(w, e: int, n0: int, n1: int) -> dict:
    """int_weight of rows n0..n1 of expert e (affine codes unpacked with the Numba unpacker: fast)."""
    sub = type(w)(w.fmt, (n1 - n0, w.shape[-1]),
                  {k: a.reshape(-1, w.shape[-2], *a.shape[len(w.shape) - 1:])[e, n0:n1] for k, a in w.arrays.items()})
    if w.fmt.kind == "affine":  # the spec's unpack_ref is exact but slow; unpack_numba is the same bits
        g = w.fmt.group_size
        K = w.shape[-1]
        c = unpack_numba(np.ascontiguousarray(sub.arrays["qweight"]), w.fmt.bits, K)
        f16 = lambda a: np.ascontiguousarray(a).view(np.float16).astype(np.float32)  # noqa: E731
        return dict(c=c[None], o=0, S=f16(sub.arrays["scales"])[None], bpg=g // QK, Z=f16(sub.arrays["biases"])[None], g=g)
    return int_weight(sub)


def pack(w) -> Packed:
    """QTensor [E, N, K] (or [N, K]) -> Packed (NumPy, expert by expert and PACK_ROWS rows at a time)."""
    N, K = w.shape[-2:]
    E = int(np.prod(w.shape[:-2], dtype=np.int64))
    bits = code_bits(w.fmt)
    NT = -(-N // ROWS) * (ROWS // 16)
    B = K // QK
    codes = np.zeros((E, NT, B * 64 * bits), np.uint8)
    S = Z = None
    for e in range(E):
        for n0 in range(0, N, PACK_ROWS):
            n1 = min(N, n0 + PACK_ROWS)
            iw = _int_rows(w, e, n0, n1)
            if S is None:
                S = np.zeros((E, NT, iw["S"].shape[-1] * 16), np.float32)
                Z = np.zeros((E, NT, iw["Z"].shape[-1] * 16), np.float32) if iw["Z"] is not None else np.zeros((E, NT, 16), np.float32)
            rows = -(-(n1 - n0) // 16) * 16
            c = np.zeros((rows, K), np.uint8)
            c[: n1 - n0] = iw["c"][0]
            t0, t1 = n0 // 16, n0 // 16 + rows // 16
            codes[e, t0:t1] = _pack_codes(c, bits)
            S[e, t0:t1] = _lanes(iw["S"][0], rows // 16)
            if iw["Z"] is not None:
                Z[e, t0:t1] = _lanes(iw["Z"][0], rows // 16)
    iw0 = _int_rows(w, 0, 0, 1)
    return Packed(codes, S, Z, bits, int(iw0["o"]), int(iw0["bpg"]), (iw0["g"] // QK) if iw0["Z"] is not None else 0, N, K)


_CACHE: dict[int, tuple] = {}


def packed(w) -> Packed:
    """``pack(w)``, once per weight object (kept while ``w`` lives)."""
    hit = _CACHE.get(id(w))
    if hit is not None and hit[0]() is w:
        return hit[1]
    p = pack(w)
    _CACHE[id(w)] = (weakref.ref(w, lambda _, k=id(w): _CACHE.pop(k, None)), p)
    return p


# ---- per-width decoders: quad vector q (0..7) of the block at byte ``base`` of a packed row ------------------
@njit(cache=True, inline="always")
def unpack8(row, base, q):
    return iv_load(row, base + 64 * q)


@njit(cache=True, inline="always")
def unpack4(row, base, q):
    v = iv_load(row, base + 64 * (q >> 1))
    return iv_and(iv_shr(v, 4 * (q & 1)), 0x0F0F0F0F)


@njit(cache=True, inline="always")
def unpack2(row, base, q):
    v = iv_load(row, base + 64 * (q >> 2))
    return iv_and(iv_shr(v, 2 * (q & 3)), 0x03030303)


@njit(cache=True, inline="always")
def unpack3(row, base, q):
    lo = iv_and(iv_shr(iv_load(row, base + 64 * (q >> 2)), 2 * (q & 3)), 0x03030303)
    hi = iv_and(iv_shr(iv_load(row, base + 128), q), 0x01010101)
    return iv_or(lo, iv_shl(hi, 2))


UNPACK = {8: unpack8, 4: unpack4, 3: unpack3, 2: unpack2}  # code width -> decoder
