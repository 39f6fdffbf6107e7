"""igemm (Numba): the prefill grouped GEMM on 8-bit activations and integer weight codes (spec:
``toolkit/ref/igemm.py``; layout and decoders: ``toolkit/cpu/igemm_pack.py``; vectors: ``toolkit/cpu/igemm_simd.py``).

Shapes: ``T`` tokens, ``R`` gathered rows (routed slots) in per-expert segments ``seg_e / seg_lo / seg_hi``
(as ``toolkit/cpu/moe_gemm.py`` builds them), ``E`` experts, ``N`` output rows, ``K`` inputs, ``B = K / 32``.

  1. ``quantize_act(x [T, K] f32) -> Act``: each token once: int8 codes, f32 block scales, int32 block sums.
  2. ``packed(w)``: the weight's codes repacked once (cached per weight object).
  3. ``_igemm`` (one template, compiled per code width with that width's decoder bound in, on first use,
     cached on disk): work items are (segment, tile of 32 output rows), split over threads with ``prange``,
     numbered tile-major, so each thread's static share holds every segment (against segment-major, Mixtral's
     gate_up at 64 tokens on 2 threads went from 148 to 202-208 GMAC/s; 1 thread unchanged within noise).
     An item walks K in chunks of ``KC`` blocks (the tile's chunk of codes, <= 32 KB, stays in L1) and,
     per chunk, the segment's rows 4 at a time (rows padded to a multiple of 4 with a zero row). The
     register tile is 4 rows x 32 outputs: 8 int32 vectors (the block's integer dots, seeded with
     ``offset * block sum``) and 8 float32 vectors; per block and quad of k: 2 weight vectors decoded
     from the packed codes, 4 broadcast activation quads, 8 ``dp4`` (``vpdpbusd`` with VNNI); per block:
     ``f += float(P) * (S * scale)``; per offset group (affine): ``f += Z * A``.
  4. The epilogue writes ``out[slot, n] = f * row_scale`` (the GEMM2 routing weight).
  5. ``_igemv``: segments of fewer than ``MR`` rows (a decode step's) take a one-row kernel instead of padding to
     4 rows: per row and block 4 dot chains, the same integer dots and f32 steps in the same order (the same
     bits). The compiled decode step calls it through ``StepWeight`` (``toolkit/cpu/decode_layer.py``).
Entry points: ``grouped_igemm`` (the inputs of ``moe_gemm.grouped_gemm``'s prefill path: gathered rows
``xg [R, K]`` in natural order) and ``moe_igemm`` (activations already quantized per token, rows given
by token index: each token quantized once however many experts it is routed to).
Formats: those with an integer form (``toolkit/formats/int_form.py``) (int8, int4/int3/int2 any group, q8_0, q4_0,
q4_K: its per-block factor ``sc`` applied per block, ``d`` and the mins once per super-block of 8 blocks: ``SUPER``);
fp8 is not integer (see the spec) and others raise NotImplementedError: keep them on the f32 path.
An edit to ``igemm_simd.py`` or to the decoders and scale loaders in ``igemm_pack.py`` makes this module's cached
kernels stale by itself (``toolkit/numba_cache.py`` stamps them with a hash of every kernel source).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..formats.int_form import QK, supported
from ._jit import Kernel, with_item
from .igemm_pack import ROWS, SCALE_LOADS, SUPER, UNPACK, kfold, packed
from .igemm_simd import dp4, dp4_small, fv_axpy, fv_load, fv_scale_acc, fv_splat, fv_store, isa, iv_add, iv_bcast4, iv_splat

CHUNK_BYTES = 16 << 10  # codes of a tile's K chunk (2 vectors x KC blocks x 64 * bits bytes): a third of L1


def chunk_blocks(bits: int) -> int:
    """KC: blocks per K chunk, a multiple of 4 (so of every offset group: 1, 2 or 4 blocks)."""
    return max(4, CHUNK_BYTES // (2 * 64 * bits) // 4 * 4)
MR = 4  # rows per register tile


@dataclass
class Act:
    """Quantized activations of T tokens plus one zero row (index T: the padding rows read it)."""
    codes: np.ndarray  # int8 [T + 1, K]
    scales: np.ndarray  # f32 [T + 1, B]
    sums: np.ndarray  # int32 [T + 1, B]


# ---- 1. activations ---------------------------------------------------------------------------------------
def _quantize_rows(x, codes, scales, sums):  # x [T, K] f32 -> codes / scales / sums rows 0..T-1
    B = scales.shape[1]
    for r in prange(x.shape[0]):
        for b in range(B):
            amax = np.float32(0.0)
            for i in range(QK):
                amax = max(amax, abs(x[r, b * QK + i]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            s = 0
            for i in range(QK):
                q = np.rint(x[r, b * QK + i] * inv)
                q = min(max(q, np.float32(-127.0)), np.float32(127.0))
                codes[r, b * QK + i] = np.int8(q)
                s += np.int32(q)
            scales[r, b] = d
            sums[r, b] = s


_quantize = Kernel(_quantize_rows)


def quantize_act(x: np.ndarray) -> Act:
    """x [T, K] f32 -> Act (codes / scales bit-identical to ``toolkit.ref.igemm.quantize_act``)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    if K % QK:
        raise ValueError(f"igemm.quantize_act: K={K} is not a multiple of {QK}")
    act = Act(np.zeros((T + 1, K), np.int8), np.zeros((T + 1, K // QK), np.float32), np.zeros((T + 1, K // QK), np.int32))
    _quantize(T * K, x, act.codes, act.scales, act.sums)
    return act


@njit(cache=True)
def act_terms(scales, sums, offset, bpz):
    """The activations' per-weight terms of the kernels, for both callers (``moe_igemm`` and the compiled decode
    step), so both get the same bits: (seed int32 [T + 1, B]: offset * block sum, the offset term riding in each
    block's integer dot; A f32 [T + 1, B / bpz]: per offset group, the sum of scale * block sum in float64 rounded
    once; [1, 1] zeros without offsets)."""
    T1, B = sums.shape
    seed = np.empty((T1, B), np.int32)
    for r in range(T1):
        for b in range(B):
            seed[r, b] = np.int32(sums[r, b] * offset)
    if bpz == 0:
        none = np.empty((1, 1), np.float32)  # (np.empty: a cold compile of np.zeros costs more than the kernel)
        none[0, 0] = 0.0
        return seed, none
    A = np.empty((T1, B // bpz), np.float32)
    for r in range(T1):
        for g in range(B // bpz):
            a = np.float64(0.0)
            for b in range(g * bpz, g * bpz + bpz):
                a += np.float64(scales[r, b]) * np.float64(sums[r, b])
            A[r, g] = np.float32(a)
    return seed, A


# ---- 2. the kernel template ------------------------------------------------------------------------------
def _igemm(codes, S, Z, sgrp, bpz, xq, sx, seed, A, xrow, slot, rscale, seg_e, seg_plo, seg_phi, out):
    """Template (compiled per code width: UNPACK, DP4, BPB bound by ``_compiled``).
    codes u8 [E, NT, B * BPB], S f32 [E, NT, GS * 16], Z f32 [E, NT, G * 16] (G = 1, zeros: no offsets) -> out
    [n_slots, N] for padded rows m in seg_plo .. seg_phi (multiples of 4): activation row xrow[m], output row
    slot[m] (-1: padding), times rscale[m]. Per block b: sgrp[b] = 16 * its scale group (q4_K: its scale word; a table, not a
    division: an ``idiv`` per block cost about as much as the block's dots); bpz: blocks per offset group
    (0: no offsets; the offsets are added per group after each K chunk, out of the block loop). One work item
    (``ITEM``: ``_igemm_item``, compiled once for the serial and the parallel build) per (segment, pair of tiles)."""
    for it in prange(seg_e.shape[0] * (codes.shape[1] // 2)):
        ITEM(np.int64(it), codes, S, Z, sgrp, bpz, xq, sx, seed, A, xrow, slot, rscale, seg_e, seg_plo, seg_phi, out)  # noqa: F821


def _igemm_item(it, codes, S, Z, sgrp, bpz, xq, sx, seed, A, xrow, slot, rscale, seg_e, seg_plo, seg_phi, out):
    """Template: work item ``it`` of ``_igemm``."""
    NT2 = codes.shape[1] // 2
    B = sx.shape[1]
    n_out = out.shape[1]
    sg, t = it % seg_e.shape[0], 2 * (it // seg_e.shape[0])  # tile-major: every thread gets every segment
    e, plo, phi = seg_e[sg], seg_plo[sg], seg_phi[sg]
    wa, wb, sa, sb = codes[e, t], codes[e, t + 1], S[e, t], S[e, t + 1]
    za, zb = Z[e, t], Z[e, t + 1]
    acc = np.zeros((phi - plo, ROWS), np.float32)  # [rows of the segment, 32 outputs]
    for b0 in range(0, B, KC):  # noqa: F821 (KC bound per width)
        for m in range(plo, phi, MR):
            r0, r1, r2, r3 = xrow[m], xrow[m + 1], xrow[m + 2], xrow[m + 3]
            x0, x1, x2, x3 = xq[r0], xq[r1], xq[r2], xq[r3]
            c0, c1, c2, c3 = acc[m - plo], acc[m - plo + 1], acc[m - plo + 2], acc[m - plo + 3]
            if SUPER:  # noqa: F821 (the f registers hold a super-block's sums; kfold folds them into acc)
                f00 = f01 = f10 = f11 = f20 = f21 = f30 = f31 = fv_splat(0.0)
            else:
                f00, f01, f10, f11 = fv_load(c0, 0), fv_load(c0, 16), fv_load(c1, 0), fv_load(c1, 16)
                f20, f21, f30, f31 = fv_load(c2, 0), fv_load(c2, 16), fv_load(c3, 0), fv_load(c3, 16)
            b1 = min(B, b0 + KC)  # noqa: F821
            for b in range(b0, b1):
                a00 = iv_bcast4(seed[r0], 4 * b)  # offset * block sum: the offset term rides in the seed
                a10 = iv_bcast4(seed[r1], 4 * b)
                a20 = iv_bcast4(seed[r2], 4 * b)
                a30 = iv_bcast4(seed[r3], 4 * b)
                a01, a11, a21, a31 = a00, a10, a20, a30
                base = b * BPB  # noqa: F821 (bound per width)
                for q in range(8):
                    wva = UNPACK(wa, base, q)  # noqa: F821
                    wvb = UNPACK(wb, base, q)  # noqa: F821
                    o = b * QK + 4 * q
                    y0, y1, y2, y3 = iv_bcast4(x0, o), iv_bcast4(x1, o), iv_bcast4(x2, o), iv_bcast4(x3, o)
                    a00, a10, a20, a30 = DP4(a00, wva, y0), DP4(a10, wva, y1), DP4(a20, wva, y2), DP4(a30, wva, y3)  # noqa: F821
                    a01, a11, a21, a31 = DP4(a01, wvb, y0), DP4(a11, wvb, y1), DP4(a21, wvb, y2), DP4(a31, wvb, y3)  # noqa: F821
                gs = sgrp[b]
                s0, s1 = SLOAD(sa, gs), SLOAD(sb, gs)  # noqa: F821
                f00, f01 = fv_scale_acc(f00, a00, s0, sx[r0, b]), fv_scale_acc(f01, a01, s1, sx[r0, b])
                f10, f11 = fv_scale_acc(f10, a10, s0, sx[r1, b]), fv_scale_acc(f11, a11, s1, sx[r1, b])
                f20, f21 = fv_scale_acc(f20, a20, s0, sx[r2, b]), fv_scale_acc(f21, a21, s1, sx[r2, b])
                f30, f31 = fv_scale_acc(f30, a30, s0, sx[r3, b]), fv_scale_acc(f31, a31, s1, sx[r3, b])
                if SUPER and b % SUPER == SUPER - 1:  # noqa: F821 (q4_K: d and the mins, into acc)
                    fv_store(c0, 0, kfold(fv_load(c0, 0), f00, sa, za, gs, A[r0], b))
                    fv_store(c0, 16, kfold(fv_load(c0, 16), f01, sb, zb, gs, A[r0], b))
                    fv_store(c1, 0, kfold(fv_load(c1, 0), f10, sa, za, gs, A[r1], b))
                    fv_store(c1, 16, kfold(fv_load(c1, 16), f11, sb, zb, gs, A[r1], b))
                    fv_store(c2, 0, kfold(fv_load(c2, 0), f20, sa, za, gs, A[r2], b))
                    fv_store(c2, 16, kfold(fv_load(c2, 16), f21, sb, zb, gs, A[r2], b))
                    fv_store(c3, 0, kfold(fv_load(c3, 0), f30, sa, za, gs, A[r3], b))
                    fv_store(c3, 16, kfold(fv_load(c3, 16), f31, sb, zb, gs, A[r3], b))
                    f00 = f01 = f10 = f11 = f20 = f21 = f30 = f31 = fv_splat(0.0)
            if SUPER:  # noqa: F821 (every K chunk ends a super-block: acc is whole)
                continue
            g0, g1 = (b0 // bpz, b1 // bpz) if bpz > 0 else (0, 0)
            for g in range(g0, g1):  # affine formats: f += Z * A, once per group
                z0, z1 = SLOAD(za, g * 16), SLOAD(zb, g * 16)  # noqa: F821
                f00, f01 = fv_axpy(f00, z0, A[r0, g]), fv_axpy(f01, z1, A[r0, g])
                f10, f11 = fv_axpy(f10, z0, A[r1, g]), fv_axpy(f11, z1, A[r1, g])
                f20, f21 = fv_axpy(f20, z0, A[r2, g]), fv_axpy(f21, z1, A[r2, g])
                f30, f31 = fv_axpy(f30, z0, A[r3, g]), fv_axpy(f31, z1, A[r3, g])
            fv_store(c0, 0, f00)
            fv_store(c0, 16, f01)
            fv_store(c1, 0, f10)
            fv_store(c1, 16, f11)
            fv_store(c2, 0, f20)
            fv_store(c2, 16, f21)
            fv_store(c3, 0, f30)
            fv_store(c3, 16, f31)
    n0 = t * 16
    for m in range(plo, phi):
        s = slot[m]
        if s >= 0:
            for j in range(min(ROWS, n_out - n0)):
                out[s, n0 + j] = acc[m - plo, j] * rscale[m]


def _igemv(codes, S, Z, sgrp, bpz, xq, sx, seed, A, xrow, slot, rscale, seg_e, seg_lo, seg_hi, out):
    """Template, the same bindings as ``_igemm``: one activation row at a time (no padding rows), for segments
    of fewer than ``MR`` rows (a decode step's, or a prefill's rarely routed experts). Work items are (segment,
    pair of row vectors); per row and block, 4 dot chains (2 vectors x even / odd quads, summed per block)
    instead of the register tile's 8, so the dots of one row do not wait on each other's latency. The same
    integer dots and the same f32 steps per block as ``_igemm``, in the same order: the same bits. One work item
    (``ITEM``: ``_igemv_item``) per (segment, pair of tiles)."""
    for it in prange(seg_e.shape[0] * (codes.shape[1] // 2)):
        ITEM(np.int64(it), codes, S, Z, sgrp, bpz, xq, sx, seed, A, xrow, slot, rscale, seg_e, seg_lo, seg_hi, out)  # noqa: F821


def _igemv_item(it, codes, S, Z, sgrp, bpz, xq, sx, seed, A, xrow, slot, rscale, seg_e, seg_lo, seg_hi, out):
    """Template: work item ``it`` of ``_igemv``."""
    NT2 = codes.shape[1] // 2
    B = sx.shape[1]
    n_out = out.shape[1]
    sg, t = it // NT2, 2 * (it % NT2)
    e = seg_e[sg]
    wa, wb, sa, sb = codes[e, t], codes[e, t + 1], S[e, t], S[e, t + 1]
    za, zb = Z[e, t], Z[e, t + 1]
    y = np.empty(ROWS, np.float32)
    n0 = t * 16
    for m in range(seg_lo[sg], seg_hi[sg]):
        r = xrow[m]
        x, sd = xq[r], seed[r]
        f0, f1 = fv_splat(0.0), fv_splat(0.0)
        g0, g1 = f0, f1
        zero = iv_splat(0)
        for b0 in range(0, B, KC):  # noqa: F821 (the offset terms after each chunk, as _igemm adds them)
            b1 = min(B, b0 + KC)  # noqa: F821
            for b in range(b0, b1):
                a0 = iv_bcast4(sd, 4 * b)
                a1, c0, c1 = a0, zero, zero
                base = b * BPB  # noqa: F821
                for q in range(0, 8, 2):
                    o = b * QK + 4 * q
                    ya, yb = iv_bcast4(x, o), iv_bcast4(x, o + 4)
                    a0, a1 = DP4(a0, UNPACK(wa, base, q), ya), DP4(a1, UNPACK(wb, base, q), ya)  # noqa: F821
                    c0, c1 = DP4(c0, UNPACK(wa, base, q + 1), yb), DP4(c1, UNPACK(wb, base, q + 1), yb)  # noqa: F821
                gs = sgrp[b]
                if SUPER:  # noqa: F821 (q4_K: a super-block's sums in g, folded into f at its end)
                    g0 = fv_scale_acc(g0, iv_add(a0, c0), SLOAD(sa, gs), sx[r, b])  # noqa: F821
                    g1 = fv_scale_acc(g1, iv_add(a1, c1), SLOAD(sb, gs), sx[r, b])  # noqa: F821
                    if b % SUPER == SUPER - 1:  # noqa: F821
                        f0, f1 = kfold(f0, g0, sa, za, gs, A[r], b), kfold(f1, g1, sb, zb, gs, A[r], b)
                        g0, g1 = fv_splat(0.0), fv_splat(0.0)
                else:
                    f0 = fv_scale_acc(f0, iv_add(a0, c0), SLOAD(sa, gs), sx[r, b])  # noqa: F821
                    f1 = fv_scale_acc(f1, iv_add(a1, c1), SLOAD(sb, gs), sx[r, b])  # noqa: F821
            if SUPER:  # noqa: F821
                continue
            g0, g1 = (b0 // bpz, b1 // bpz) if bpz > 0 else (0, 0)
            for g in range(g0, g1):  # affine formats: f += Z * A, once per group
                f0, f1 = fv_axpy(f0, SLOAD(za, g * 16), A[r, g]), fv_axpy(f1, SLOAD(zb, g * 16), A[r, g])  # noqa: F821
        fv_store(y, 0, f0)
        fv_store(y, 16, f1)
        s = slot[m]
        for j in range(min(ROWS, n_out - n0)):
            out[s, n0 + j] = y[j] * rscale[m]


_ITEMS = {_igemm: _igemm_item, _igemv: _igemv_item}


def _bound(template, name: str, bits: int, kind: str, cache: bool = True) -> tuple:
    """(``template`` with one code width's decoder, dot and scale loads bound in, its work item's dispatcher)."""
    assert chunk_blocks(bits) % max(1, SUPER[kind]) == 0  # a K chunk ends a super-block (the kernels' fold)
    return with_item(template, _ITEMS[template], f"__{name}{bits}{kind}", {}, cache, UNPACK=UNPACK[bits],
                     DP4=dp4 if bits == 8 else dp4_small, BPB=64 * bits, KC=chunk_blocks(bits),
                     SLOAD=SCALE_LOADS[kind], SUPER=SUPER[kind])


@functools.cache
def _compiled(bits: int, kind: str = "h") -> Kernel:
    """The register-tiled kernel for one code width and scale layout (``Packed.kind``: f16 bits, f32 or q4_K's),
    its decoder and dot bound in; compiled on first call, cached on disk."""
    return Kernel(_bound(_igemm, "w", bits, kind)[0])


@functools.cache
def _compiled_gemv(bits: int, kind: str = "h") -> Kernel:
    """The one-row kernel for one code width and scale layout."""
    return Kernel(_bound(_igemv, "v", bits, kind)[0])


# ---- 3. entry points ----------------------------------------------------------------------------------------
def _padded(rows, slots, seg_lo, seg_hi, scale, zero_row):
    """Per-segment row ranges padded to multiples of MR: (xrow, slot, rscale [Rp], plo, phi [S])."""
    lens = (seg_hi - seg_lo).astype(np.int64)
    plen = -(-lens // MR) * MR
    phi = np.cumsum(plen)
    plo = phi - plen
    Rp = int(phi[-1]) if len(phi) else 0
    xrow = np.full(Rp, zero_row, np.int64)
    slot = np.full(Rp, -1, np.int64)
    rscale = np.zeros(Rp, np.float32)
    for p, lo, hi in zip(plo, seg_lo, seg_hi):
        n = hi - lo
        xrow[p:p + n], slot[p:p + n], rscale[p:p + n] = rows[lo:hi], slots[lo:hi], scale[lo:hi]
    return xrow, slot, rscale, plo, phi


def moe_igemm(w, act: Act, rows, slots, seg_e, seg_lo, seg_hi, scale=None, n_slots=None, out=None, path=None):
    """w QTensor [E, N, K]; act from ``quantize_act`` (T tokens); gathered row i of segment s
    (seg_lo[s] <= i < seg_hi[s], expert seg_e[s]) reads token rows[i] and writes out[slots[i]] (times
    scale[i]) -> out f32 [n_slots, N] (rows no segment covers: 0, or left as given in ``out``).
    ``path``: None runs segments of fewer than ``MR`` rows on the one-row kernel and the others on the
    register tile; "gemv" / "gemm" force one kernel (the two give the same bits)."""
    if not supported(w.fmt):
        raise NotImplementedError(f"igemm: format {w.fmt.spec!r} has no integer kernel; use the f32 path")
    p = packed(w)
    if act.codes.shape[1] != p.K:
        raise ValueError(f"igemm: activations have K={act.codes.shape[1]} but weight {w.shape} has K={p.K}")
    seg_e, seg_lo, seg_hi = (np.ascontiguousarray(a, np.int64) for a in (seg_e, seg_lo, seg_hi))
    slots = np.ascontiguousarray(slots, np.int64)
    n_slots = int(slots.max()) + 1 if n_slots is None else n_slots
    scale = np.ones(slots.shape[0], np.float32) if scale is None else np.ascontiguousarray(scale, np.float32)
    T = act.codes.shape[0] - 1
    if out is None:
        out = np.zeros((n_slots, p.N), np.float32)
    seed, A = act_terms(act.scales, act.sums, p.offset, p.bpz)
    seed = seed.view(np.uint8)  # [T + 1, 4B]: the kernels broadcast a block's 4 bytes
    rows = np.asarray(rows, np.int64)
    lens = seg_hi - seg_lo
    short = lens < MR if path is None else np.full(lens.shape, path == "gemv")
    if short.any():
        e, lo, hi = seg_e[short], seg_lo[short], seg_hi[short]
        _compiled_gemv(p.bits, p.kind)(int((hi - lo).sum()) * p.N * p.K, p.codes, p.S, p.Z, p.sgrp, p.bpz, act.codes,
                               act.scales, seed, A, rows, slots, scale, e, lo, hi, out)
    if not short.all():
        e, lo, hi = seg_e[~short], seg_lo[~short], seg_hi[~short]
        xrow, slot, rscale, plo, phi = _padded(rows, slots, lo, hi, scale, T)
        _compiled(p.bits, p.kind)(int((hi - lo).sum()) * p.N * p.K, p.codes, p.S, p.Z, p.sgrp, p.bpz, act.codes, act.scales,
                          seed, A, xrow, slot, rscale, e, plo, phi, out)
    return out


def igemm(codes, scales, w, seg_e, seg_lo, seg_hi, rows=None, path=None):
    """The op, with the reference's signature (``toolkit/ref/igemm.py``): ``codes int8 [T, K]``, ``scales f32
    [T, B]`` (``quantize_act``'s), ``w`` QTensor ``[E, N, K]``, segments over the gathered rows (row i reads
    activation row ``rows[i]``, default i) -> ``f32 [R, N]``, ``R = max(seg_hi)`` (rows outside every segment 0)."""
    codes = np.ascontiguousarray(codes, np.int8)
    T, K = codes.shape
    R = int(max(seg_hi)) if len(seg_hi) else 0
    rows = np.arange(R) if rows is None else np.asarray(rows)
    pad = lambda a: np.concatenate([a, np.zeros((1,) + a.shape[1:], a.dtype)])  # noqa: E731 - the zero row T
    sums = codes.reshape(T, K // QK, QK).sum(axis=-1, dtype=np.int32)  # [T, B]
    act = Act(pad(codes), pad(np.ascontiguousarray(scales, np.float32)), pad(sums))
    return moe_igemm(w, act, rows, np.arange(R), seg_e, seg_lo, seg_hi, None, R, path=path)


@dataclass
class StepWeight:
    """A weight as the compiled decode step (``toolkit/cpu/decode_layer.py``) passes it to the one-row kernel:
    ``arrays`` = (codes, S, Z, sgrp, params int64 [offset, bpz, N]) of its packing; ``kernel`` that width's build."""
    arrays: tuple
    suffix: str
    kernel: Kernel


def step_weight(w) -> StepWeight:
    """``w``'s packing for the compiled decode step (made once, kept beside the packing)."""
    from .decoders import packed as cached

    def make(w):
        p = packed(w)
        return StepWeight((p.codes, p.S, p.Z, p.sgrp, np.array([p.offset, p.bpz, p.N], np.int64)),
                          f"__igemv{p.bits}{p.kind}", _compiled_gemv(p.bits, p.kind))
    return cached(w, None, key="igemm-step", pack=make)


def grouped_igemm(w, xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, N=None):
    """Drop-in for the prefill path of ``moe_gemm.grouped_gemm``: xg [R, K] f32 gathered rows in natural
    order (not the decoder's permuted order), slots [R], segments, scale [R], n_slots -> out [n_slots, N].
    Each gathered row is quantized (a token routed to A experts is quantized A times, identically);
    ``moe_igemm`` takes per-token activations instead."""
    act = quantize_act(xg)
    return moe_igemm(w, act, np.arange(xg.shape[0]), slots, seg_e, seg_lo, seg_hi, scale, n_slots)


def assembly(spec: str) -> str:
    """The register-tiled kernel's work item's assembly (``_igemm_item``: the loops) for format ``spec`` on the
    current Numba target (an uncached build: Numba cannot inspect code loaded from its disk cache). For the
    assembly test and reports."""
    from ..formats import get_format
    fmt = get_format(spec)
    w = fmt.quantize(np.linspace(-1, 1, 32 * 256, dtype=np.float32).reshape(1, 32, 256), "numpy")  # K: one q4_K block
    p = packed(w)
    outer, item = _bound(_igemm, "asm", p.bits, p.kind, cache=False)
    fn = njit(cache=False)(outer)
    act = quantize_act(np.ones((4, 256), np.float32))
    i64 = np.zeros(1, np.int64)
    seed, A = act_terms(act.scales, act.sums, p.offset, p.bpz)
    fn(p.codes, p.S, p.Z, p.sgrp, p.bpz, act.codes, act.scales, seed.view(np.uint8), A,
       np.zeros(4, np.int64), np.full(4, -1, np.int64), np.zeros(4, np.float32), i64, i64, i64 + 4,
       np.zeros((1, 32), np.float32))
    return item.inspect_asm(item.signatures[0])


MULTIPLY_ADDS = ("vpdpbusd", "vpdpwssd", "vpmaddubsw", "vpmaddwd")


def mnemonic(line: str) -> str:
    """The instruction of an assembly line, without an encoding prefix such as ``{vex}``."""
    words = [w for w in line.split() if not w.startswith("{")]
    return words[0] if words else ""


def hot_loop(asm: str) -> list[str]:
    """The instructions of the innermost loop (label .. backward jump to it) holding the most integer
    multiply-adds of ``MULTIPLY_ADDS`` ([] when none has any)."""
    lines = [ln.strip() for ln in asm.splitlines()]
    labels, best, best_n = {}, [], 0
    for i, ln in enumerate(lines):
        if ln.endswith(":") and not ln.startswith("#"):
            labels[ln[:-1]] = i
        elif ln.startswith("j") and len(ln.split()) == 2 and labels.get(ln.split()[1], i) < i:
            body = [x for x in lines[labels[ln.split()[1]] + 1:i + 1] if x and not x.startswith((".", "#"))]
            n = sum(1 for x in body if mnemonic(x) in MULTIPLY_ADDS)
            if n > best_n or (n == best_n and n and len(body) < len(best)):
                best, best_n = body, n
    return best


__all__ = ["Act", "assembly", "hot_loop", "mnemonic", "grouped_igemm", "igemm", "isa", "moe_igemm", "packed", "quantize_act", "supported"]
