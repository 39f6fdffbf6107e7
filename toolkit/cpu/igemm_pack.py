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
      and the affine formats, f32 for int8's per-row scales (``Packed.kind``).
  q4_K (``Packed.kind`` "k"): ``S`` / ``Z`` uint16 [E, NT, K / 256 * 80] as stored, not multiplied out: per
      super-block ``j`` of a row vector, 80 words: the 16 rows' f16 ``d`` (``Z``: ``-dmin``, the sign flipped so
      that the kernel adds), then 128 bytes, block ``i``'s 16 rows' 6-bit ``sc`` (``Z``: ``m``) at byte
      ``32 + 16 i + lane``. The kernels multiply by ``sc`` per block and by ``d`` (and add the mins' term) once per
      super-block (``ksc``, ``kfold``). 4.625 bits a weight against q4_K's 4.5 (``d * sc`` and ``dmin * m`` as f32
      per block would be 6).
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
from .igemm_simd import fv_axpy, fv_fma, fv_load, fv_load_half, fv_load_u8, fv_splat, iv_and, iv_load, iv_or, iv_shl, iv_shr

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
    kq: bool = False  # q4_K's super-block layout of S and Z (the module docstring)

    @functools.cached_property
    def sgrp(self) -> np.ndarray:
        """int64 [B]: 16 * the scale group of each block (the kernels' table, made once per packing); q4_K: the word
        of block b's 16 ``sc`` bytes in its super-block (``ksc`` loads there, no index arithmetic in the loop)."""
        b = np.arange(self.K // QK, dtype=np.int64)
        if self.kq:
            return (b // 8) * KQ_WORDS + 16 + 8 * (b % 8)
        return (b // self.bpg) * 16

    @property
    def kind(self) -> str:
        """The scale layout the kernels are built for (``SCALE_LOADS``): "h" f16 bits, "" f32, "k" q4_K's."""
        return "k" if self.kq else "h" if self.S.dtype == np.uint16 else ""

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


KQ_WORDS = 80  # uint16 words of q4_K's S (or Z) per super-block and row vector: 16 halves, then 8 x 16 bytes


def _put_kq(a: np.ndarray, n0: int, half: np.ndarray, f6: np.ndarray) -> None:
    """Rows n0 .. n0 + n of one expert's q4_K S or Z (``a`` uint16 [NT, NSB * 80]): ``half`` uint16 [n, NSB] (d or
    -dmin bits), ``f6`` u8 [n, NSB, 8] (sc or m)."""
    n = np.arange(n0, n0 + half.shape[0])
    t, lane = n // 16, n % 16
    a.reshape(a.shape[0], -1, KQ_WORDS)[t, :, lane] = half
    b = a.view(np.uint8).reshape(a.shape[0], -1, 2 * KQ_WORDS)
    for i in range(8):
        b[t, :, 32 + 16 * i + lane] = f6[:, :, i]


def _get_kq(a: np.ndarray, n0: int, n1: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``_put_kq``: (half uint16 [n, NSB], f6 u8 [n, NSB, 8]) of rows n0 .. n1."""
    n = np.arange(n0, n1)
    t, lane = n // 16, n % 16
    half = a.reshape(a.shape[0], -1, KQ_WORDS)[t, :, lane]
    b = a.view(np.uint8).reshape(a.shape[0], -1, 2 * KQ_WORDS)
    return half, np.stack([b[t, :, 32 + 16 * i + lane] for i in range(8)], axis=-1)


def _pack_kq(w, codes, E, NT, N, K) -> Packed:
    """q4_K pieces -> Packed: codes as any 4-bit form's, d / sc and -dmin / m in the super-block layout."""
    from ..formats.kquant import fields
    from ..mapped import file_ranges, release

    ranges, nsb = file_ranges(), K // 256
    S = np.zeros((E, NT, nsb * KQ_WORDS), np.uint16)
    Z = np.zeros((E, NT, nsb * KQ_WORDS), np.uint16)
    for e, n0, sub in w.pieces(PACK_ROWS):
        n = sub.shape[0]
        f = fields(w.fmt.name, sub.arrays["blocks"])
        c = f.codes.reshape(n, K)
        _pack_rows(c.size, c, n0, 4, codes[e])
        _put_kq(S[e], n0, f.d.reshape(n, nsb), f.sc.view(np.uint8).reshape(n, nsb, 8))
        _put_kq(Z[e], n0, (f.dmin ^ np.uint16(0x8000)).reshape(n, nsb), f.m.view(np.uint8).reshape(n, nsb, 8))
        release(sub.stored(), ranges)
    return Packed(codes, S, Z, 4, 0, 1, 1, N, K, kq=True)


def _unpack_kq(p: Packed, e: int, n0: int, n1: int, c: np.ndarray) -> np.ndarray:
    """Rows n0 .. n1 of expert e of a q4_K packing (codes ``c`` u8 [n, K] already unpacked) -> blocks u8 [n, K / 256 * 144]."""
    from ..formats.kquant import Fields, q4_k_blocks

    d, sc = _get_kq(p.S[e], n0, n1)
    dmin, m = _get_kq(p.Z[e], n0, n1)
    f = Fields(c.reshape(-1, 256), d.reshape(-1), sc.reshape(-1, 8).view(np.int8), (dmin ^ np.uint16(0x8000)).reshape(-1),
               m.reshape(-1, 8).view(np.int8))
    return q4_k_blocks(f).reshape(n1 - n0, -1)


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
    if w.fmt.int_form == "kquant":
        return _pack_kq(w, codes, E, NT, N, K)
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
            if fmt.int_form == "kquant":
                out["blocks"][e, n0:n1] = _unpack_kq(p, e, n0, n1, c)
                continue
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


# ---- scale loaders: the 16 lanes' scales (or offsets) of a row vector at word ``at`` (``Packed.sgrp``) ----------
@njit(cache=True, inline="always")
def ksc(s, at):
    """q4_K (``Packed.kind`` "k"): a block's 6-bit ``sc`` (S) or ``m`` (Z) at word ``at`` as float32: the per-block
    factor of the kernels' super-block form (``kfold`` applies ``d`` and the mins once per super-block)."""
    return fv_load_u8(s, at)


@njit(cache=True, inline="always")
def kfold(f, g, s, z, at, arow, b):
    """The end of a q4_K super-block (its last block ``b``, ``at`` = that block's ``sgrp``) for one row vector: ``g``
    the super-block's ``sum float(P) * (sc * sx)`` -> ``f + d * g + (-dmin) * sum_i m_i * A[i]`` (the mins' term
    once per super-block, in block order), both kernels the same steps: the same bits."""
    j = at - 16 - 8 * 7  # the super-block's first word: its 16 halves
    f = fv_fma(fv_load_half(s, j), g, f)
    h = fv_axpy(fv_splat(0.0), fv_load_u8(z, j + 16), arow[b - 7])
    for i in range(1, 8):
        h = fv_axpy(h, fv_load_u8(z, j + 16 + 8 * i), arow[b - 7 + i])
    return fv_fma(fv_load_half(z, j), h, f)


SCALE_LOADS = {"": fv_load, "h": fv_load_half, "k": ksc}  # Packed.kind -> the kernels' SLOAD
SUPER = {"": 0, "h": 0, "k": 8}  # Packed.kind -> blocks per super-block of the deferred form (0: none)
