"""igemm_pack: a weight's integer codes in the layout the integer GEMM reads (once per weight), and the
per-width code decoders the kernel template is compiled with.

Shapes: ``E`` experts, ``N`` output rows, ``K`` inputs, ``B = K / 32`` blocks, ``NT = ceil(N / 32) * 2``
row vectors of 16 rows (padded to pairs: the kernel's tile is 2 vectors), ``GS`` scale groups, ``G``
offset groups.

The integer form of a format comes from its record (``toolkit/formats/int_form.py::int_weight``): unsigned codes
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
  ``S`` [E, NT, GS * 16]: lane-ordered scales, group-major; ``Z`` [E, NT, G * 16] (affine; zeros [E, NT, 16] otherwise);
      both as the format stores them: f16 bits (uint16; the kernels widen them with ``vcvtph2ps``) for q4_0, q8_0
      and the affine formats, f32 for int8's per-row scales (``Packed.half``).
Padded rows have code 0 and scale 0. Repacking is a permutation of the codes and scales: the copy has the size
of the stored weight (q4_0: 4.5 bits a weight; int4-g128: 4.25; q8_0: 8.5), plus 32-row padding.
With int8 activations (the default) this is the only CPU layout of such a weight: made at load
(``moe_gemm.prepare_weight``) a piece at a time, the mapped pages it replaces handed back, and for a weight
quantized at load the stored arrays dropped: ``unpack`` rebuilds them byte for byte when an export reads them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..formats.packing import pack_numba, unpack_numba
from ..formats.int_form import QK, int_weight
from ._jit import kernel
from .igemm_simd import iv_and, iv_load, iv_or, iv_shl, iv_shr

ROWS = 32  # rows per kernel tile (2 vectors of 16)
PACK_ROWS = 2048  # rows repacked at a time (bounds the temporary int copies)


@dataclass
class Packed:
    codes: np.ndarray  # u8 [E, NT, B * 64 * bits]
    S: np.ndarray  # f16 bits (uint16) or f32 [E, NT, GS * 16]
    Z: np.ndarray  # the same type [E, NT, G * 16], or [E, NT, 16] zeros
    bits: int  # code width: 8, 4, 3, 2
    offset: int  # o: the integer added to every code
    bpg: int  # blocks per scale group
    bpz: int  # blocks per offset group (0: no offsets)
    N: int
    K: int

    @functools.cached_property
    def sgrp(self) -> np.ndarray:
        """int64 [B]: 16 * the scale group of each block (the kernels' table, made once per packing)."""
        return (np.arange(self.K // QK, dtype=np.int64) // self.bpg) * 16

    @property
    def half(self) -> bool:
        """Scales and offsets as f16 bits (the kernels' build for them), else f32."""
        return self.S.dtype == np.uint16

    @property
    def arrays(self) -> tuple:
        return (self.codes, self.S, self.Z)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.S.nbytes + (self.Z.nbytes if self.bpz else 0)


def code_bits(fmt) -> int:
    return 8 if fmt.bits == 8 else fmt.bits


@kernel()  # serial below PARALLEL_MIN_WORK (toolkit/cpu/_jit.py)
def _pack_rows(c, n0, bits, out):
    """c u8 [n, K] natural-order codes of rows n0 .. n0 + n -> their bytes of out u8 [NT, B * 64 * bits] (one
    expert), in the layout above: code k = 32b + 4q + j of row 16t + l belongs to byte 4l + j of quad vector q
    of block b. Rows may start anywhere: each row writes its own lane's bytes (per bits: which quads share a
    byte, at which shift)."""
    B = c.shape[1] // QK
    per = 8 // bits if bits != 3 else 4
    shift = 8 // per
    BPB = 64 * bits
    for i in prange(c.shape[0]):
        row = c[i]
        t, lane = (n0 + i) // 16, (n0 + i) % 16
        o = out[t]
        for b in range(B):
            for v in range(8 // per):  # byte vectors of the block (3 bits: the two 2-bit planes first)
                for j in range(4):
                    acc = 0
                    for k in range(per):
                        code = np.int32(row[QK * b + 4 * (per * v + k) + j])
                        acc |= ((code & 3) if bits == 3 else code) << (shift * k)
                    o[b * BPB + 64 * v + 4 * lane + j] = np.uint8(acc)
            if bits == 3:  # the 1-bit plane: bit q of byte 4l + j is the high bit of quad q
                for j in range(4):
                    acc = 0
                    for q in range(8):
                        acc |= ((np.int32(row[QK * b + 4 * q + j]) >> 2) & 1) << q
                    o[b * BPB + 128 + 4 * lane + j] = np.uint8(acc)


@kernel()
def _unpack_rows(packed, n0, bits, c):
    """The inverse of ``_pack_rows``: rows n0 .. n0 + n of one expert's packed codes -> c u8 [n, K]."""
    B = c.shape[1] // QK
    per = 8 // bits if bits != 3 else 4
    shift = 8 // per
    mask = (1 << shift) - 1
    BPB = 64 * bits
    for i in prange(c.shape[0]):
        t, lane = (n0 + i) // 16, (n0 + i) % 16
        o = packed[t]
        for b in range(B):
            for v in range(8 // per):
                for j in range(4):
                    byte = np.int32(o[b * BPB + 64 * v + 4 * lane + j])
                    for k in range(per):
                        c[i, QK * b + 4 * (per * v + k) + j] = np.uint8((byte >> (shift * k)) & mask)
            if bits == 3:
                for j in range(4):
                    byte = np.int32(o[b * BPB + 128 + 4 * lane + j])
                    for q in range(8):
                        c[i, QK * b + 4 * q + j] |= np.uint8(((byte >> q) & 1) << 2)


@kernel()
def _pack_blocks(blk, n0, bits, out, S):
    """GGML blocks of rows n0 .. n0 + n of one expert (blk u8 [n, B * (2 + 4 * bits)]: f16 d, then the quants) ->
    their codes in ``out`` [NT, B * 64 * bits] and their d in ``S`` [NT, B * 16] (f16 bits), in one pass (the codes ``_pack_rows``
    would write from ``int_weight``'s, without its temporaries). q8_0: codes q + 128 (a flipped sign bit); q4_0:
    code k of a block is the low nibble of byte k (k < 16) or the high nibble of byte k - 16."""
    bpb = 2 + 4 * bits
    B = blk.shape[1] // bpb
    BPB = 64 * bits
    for i in prange(blk.shape[0]):
        t, lane = (n0 + i) // 16, (n0 + i) % 16
        o, srow, row = out[t], S[t], blk[i]
        for b in range(B):
            at = b * bpb
            srow[b * 16 + lane] = np.uint16(row[at]) | (np.uint16(row[at + 1]) << np.uint16(8))  # d's f16 bits
            qs = at + 2
            if bits == 8:
                for q in range(8):
                    for j in range(4):
                        o[b * BPB + 64 * q + 4 * lane + j] = row[qs + 4 * q + j] ^ np.uint8(0x80)
            else:  # byte (v, j): code 8v + j low, code 8v + 4 + j high
                for v in range(4):
                    for j in range(4):
                        k0, k1 = 8 * v + j, 8 * v + 4 + j
                        c0 = row[qs + k0] & np.uint8(15) if k0 < 16 else row[qs + k0 - 16] >> np.uint8(4)
                        c1 = row[qs + k1] & np.uint8(15) if k1 < 16 else row[qs + k1 - 16] >> np.uint8(4)
                        o[b * BPB + 64 * v + 4 * lane + j] = c0 | (c1 << np.uint8(4))


def _lane_view(a: np.ndarray) -> np.ndarray:
    """f32 [NT, G * 16] lane-ordered values of one expert as [NT, G, 16] (a view)."""
    return a.reshape(a.shape[0], -1, 16)


def _put_lanes(a: np.ndarray, n0: int, vals: np.ndarray) -> None:
    """Rows n0 .. n0 + n of values [n, G] into one expert's lane-ordered [NT, G * 16] (f16 bits: values that came
    from f16, so exactly)."""
    n = np.arange(n0, n0 + vals.shape[0])
    _lane_view(a)[n // 16, :, n % 16] = vals.astype(np.float16).view(np.uint16) if a.dtype == np.uint16 else vals


def _get_lanes(a: np.ndarray, n0: int, n1: int) -> np.ndarray:
    """f32 [n, G] of rows n0 .. n1."""
    n = np.arange(n0, n1)
    v = _lane_view(a)[n // 16, :, n % 16]  # [n, G]
    return v.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else v


def _int_piece(sub) -> dict:
    """int_weight of a [rows, K] piece (affine codes unpacked with the Numba unpacker: fast)."""
    if sub.fmt.int_form == "affine":  # the spec's unpack_ref is exact but slow; unpack_numba is the same bits
        g, K = sub.fmt.group_size, sub.shape[-1]
        c = unpack_numba(np.ascontiguousarray(sub.arrays["qweight"]), sub.fmt.bits, K)
        f16 = lambda a: np.ascontiguousarray(a).view(np.float16).astype(np.float32)  # noqa: E731
        return dict(c=c[None], o=0, S=f16(sub.arrays["scales"])[None], bpg=g // QK, Z=f16(sub.arrays["biases"])[None],
                    g=g)
    return int_weight(sub)


def pack(w) -> Packed:
    """QTensor [E, N, K] (or [N, K]) -> Packed, piece by piece (``QTensor.pieces``: at most PACK_ROWS rows of one
    expert, a joined tensor's parts apart, never concatenated); each piece's stored pages are handed back once
    packed when they are a read-only file mapping (``toolkit.mapped.release``): the packed codes replace the
    mapped ones in memory instead of adding to them."""
    from ..mapped import file_ranges, release

    N, K = w.shape[-2:]
    E = int(np.prod(w.shape[:-2], dtype=np.int64))
    bits = code_bits(w.fmt)
    NT = -(-N // ROWS) * (ROWS // 16)
    codes = np.zeros((E, NT, K // QK * 64 * bits), np.uint8)
    S = Z = None
    meta, ranges = None, file_ranges()
    if w.fmt.int_form == "block":  # q4_0 / q8_0 (GGUF's): straight from the blocks, one pass
        S = np.zeros((E, NT, K // QK * 16), np.uint16)
        Z = np.zeros((E, NT, 16), np.uint16)
        for e, n0, sub in w.pieces(PACK_ROWS):
            blk = np.ascontiguousarray(sub.arrays["blocks"]).reshape(sub.shape[0], -1)
            _pack_blocks(blk.size, blk, n0, bits, codes[e], S[e])
            release(sub.stored(), ranges)
        return Packed(codes, S, Z, bits, -128 if bits == 8 else -8, 1, 0, N, K)
    for e, n0, sub in w.pieces(PACK_ROWS):
        iw = _int_piece(sub)
        if S is None:  # scales as stored: f16 for the affine formats, f32 for int8's per-row ones
            dt = np.uint16 if w.fmt.int_form == "affine" else np.float32
            S = np.zeros((E, NT, iw["S"].shape[-1] * 16), dt)
            Z = np.zeros((E, NT, (iw["Z"].shape[-1] if iw["Z"] is not None else 1) * 16), dt)
            meta = iw
        c = np.ascontiguousarray(iw["c"][0])
        _pack_rows(c.size, c, n0, bits, codes[e])
        _put_lanes(S[e], n0, iw["S"][0])
        if iw["Z"] is not None:
            _put_lanes(Z[e], n0, iw["Z"][0])
        release(sub.stored(), ranges)
    bpz = meta["g"] // QK if meta["Z"] is not None else 0
    return Packed(codes, S, Z, bits, int(meta["o"]), int(meta["bpg"]), bpz, N, K)


def unpack(fmt, shape: tuple, p: Packed) -> dict:
    """The stored arrays of a weight of format ``fmt`` and ``shape``, rebuilt exactly from its packing ``p`` (the
    inverse of ``pack``: a weight quantized at load keeps only the packed layout)."""
    N, K = p.N, p.K
    E = p.codes.shape[0]
    want = fmt.arrays(tuple(shape))
    out = {k: np.empty((E, N) + v.shape[len(shape) - 1:], v.dtype) for k, v in want.items()}
    for e in range(E):
        for n0 in range(0, N, PACK_ROWS):
            n1 = min(N, n0 + PACK_ROWS)
            c = np.empty((n1 - n0, K), np.uint8)
            _unpack_rows(c.size, p.codes[e], n0, p.bits, c)
            S = _get_lanes(p.S[e], n0, n1)  # [n, GS]
            if fmt.int_form == "block":
                blk = out["blocks"][e, n0:n1].reshape(n1 - n0, K // QK, -1)
                blk[..., :2] = S.astype(np.float16)[..., None].view(np.uint8)
                cb = c.reshape(n1 - n0, K // QK, QK)
                if fmt.bits == 8:
                    blk[..., 2:] = (cb.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
                else:
                    blk[..., 2:] = cb[..., :16] | (cb[..., 16:] << np.uint8(4))
            elif fmt.int_form == "affine":
                out["qweight"][e, n0:n1] = pack_numba(c, fmt.bits)
                out["scales"][e, n0:n1] = S.astype(np.float16).view(out["scales"].dtype)
                out["biases"][e, n0:n1] = _get_lanes(p.Z[e], n0, n1).astype(np.float16).view(out["biases"].dtype)
            else:  # "channel8": int8 per channel
                out["qweight"][e, n0:n1] = (c.astype(np.int16) - 128).astype(np.int8)
                out["scales"][e, n0:n1] = S[:, 0].astype(out["scales"].dtype)
    return {k: v.reshape(want[k].shape) for k, v in out.items()}


def packed(w) -> Packed:
    """``pack(w)``, once per weight object (kept while ``w`` lives, beside its other CPU packings:
    ``toolkit.cpu.decoders.packed``)."""
    from .decoders import packed as cached

    return cached(w, None, key=KEY, pack=pack)


KEY = "igemm"  # the packing's key among a weight's CPU packings


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
