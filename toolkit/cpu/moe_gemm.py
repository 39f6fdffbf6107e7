"""moe_gemm (Numba): grouped GEMM over the M-blocks of a moe_align layout, dequantization fused in.

Shapes: ``x [T, K]`` (GEMM1) or ``[T*A, K]`` (GEMM2, ``x_is_slots``); ``w`` QTensor ``[E, N, K]`` in any
registry format; ``sorted_ids [P]``, ``expert_ids [P / block_m]`` -> ``out f32 [T*A, N]`` (spec:
``toolkit/ref/moe_gemm.py``). The blocks are first compacted into per-expert segments of real slots
(``seg_e / seg_lo / seg_hi`` over ``xg [R, K]``, the gathered input rows; ``R`` routed slots).

One pair of kernel templates serves every format: ``_Kernel`` compiles them per format with that format's
row operations bound in (``row_ops`` of the decoder code ``DECODERS[(kind, bits)]`` gives, in
``toolkit/cpu/decoders.py``), so only the formats a model uses are compiled, each once per machine
(``cache=True``, under its own name); no kernel source is copied per bit width:
  decode path (segments of <= ``DECODE_MAX_ROWS`` rows; GEMV-like): over (segment, block of ``ROW_BLOCK``
      output rows), ``prange`` when the work pays for the threads (``toolkit/cpu/_jit.py``); each weight
      row is dotted with every input row of that expert (``dot_rows``: affine formats at <= 3 rows fuse
      decode and dot per group, scale and offset applied per group; otherwise the row is decoded once
      into a per-thread ``[K]`` f32 buffer).
  prefill path (longer segments; compute-bound): for each expert and tile of ``tile`` output rows, the
      tile is decoded (serially; BLAS owns the threads) into one f32 scratch of at most ``SCRATCH_BYTES`` and the
      expert's gathered rows are multiplied by it with NumPy's BLAS (``x_e @ tile.T``).
No dequantized copy of a whole expert ever exists.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from ..ref.moe_gemm import act_dequant
from ._jit import Kernel, twin
from .decoders import DECODERS, group_sums, row_ops

DECODE_MAX_ROWS = 8  # rows per expert up to which the GEMV path wins
ROW_BLOCK = 32  # output rows per decode-path work item
SCRATCH_BYTES = 1 << 20  # prefill tile scratch bound


def _gemv(w, xg, xsum, seg_e, seg_lo, seg_hi, slot, scale, n_out, out):
    """Template (compiled per format by ``_Kernel``): every segment's rows against blocks of weight rows."""
    K = xg.shape[1]
    n_rb = (n_out + ROW_BLOCK - 1) // ROW_BLOCK
    for it in prange(seg_e.shape[0] * n_rb):
        sg, rb = it // n_rb, it % n_rb
        e, lo, hi = seg_e[sg], seg_lo[sg], seg_hi[sg]
        n0, n1 = rb * ROW_BLOCK, min(n_out, (rb + 1) * ROW_BLOCK)
        buf = np.empty(K, np.float32)  # one decoded weight row
        res = np.empty((hi - lo, n1 - n0), np.float32)  # [rows of the segment, output rows of the block]
        dot_rows(w, e, n0, n1, xg, xsum, lo, hi, buf, res)  # noqa: F821 (bound per format)
        for m in range(lo, hi):
            for n in range(n0, n1):
                out[slot[m], n] = res[m - lo, n - n0] * scale[m]


# serial on purpose: BLAS owns the threads in the prefill path (a Numba pool waking between BLAS calls
# fights OpenBLAS's spinning threads on a busy machine); decoding a tile is < 1/(2 n_e) of its FLOPs
def _decode_tile(w, e, n0, tile):  # tile [rows, K] <- rows n0.. of expert e
    decode_rows(w, e, n0, tile)  # noqa: F821 (bound per format)


class _Kernel:
    """A format's prepare / GEMV / tile-decode triple: the kernel templates compiled with its decoder alone."""

    def __init__(self, fmt):
        key = (fmt.kind, fmt.bits)
        if key not in DECODERS:
            raise NotImplementedError(f"moe_gemm: no Numba decoder for format {fmt.spec!r} (kind, bits) = {key}")
        self.prepare, self.code, self.perm = DECODERS[key](fmt)
        self._gemv, self._decode_tile = _compiled(self.code)

    def gemv(self, w, xg, xsum, seg_e, seg_lo, seg_hi, slot, scale, n_out, out):
        work = int((seg_hi - seg_lo).sum()) * n_out * xg.shape[1]  # multiply-adds
        self._gemv(work, w, xg, xsum, seg_e, seg_lo, seg_hi, slot, scale, n_out, out)

    def decode_tile(self, w, e, n0, tile):
        self._decode_tile(w, e, n0, tile)


@functools.cache
def _compiled(code: int) -> tuple:
    """The GEMV kernel pair and the tile decoder of one decoder code (shared by formats with that code)."""
    name, decode_rows, dot_rows = row_ops(code)
    return (Kernel(twin(_gemv, f"__{name}", dot_rows=dot_rows), fastmath=True),
            njit(cache=True)(twin(_decode_tile, f"__{name}", decode_rows=decode_rows)))


_KERNELS: dict[str, _Kernel] = {}


def kernel_for(fmt) -> _Kernel:
    if fmt.name not in _KERNELS:  # the group size is a run-time value: int4-g32 and int4-g128 share kernels
        _KERNELS[fmt.name] = _Kernel(fmt)
    return _KERNELS[fmt.name]


@njit(cache=True)
def _segments(sorted_ids, expert_ids, block_m, n_slots):
    """Blocks -> per-expert runs of real slots: slots [R], seg_e / seg_lo / seg_hi [S]."""
    slots = np.empty(sorted_ids.shape[0], np.int64)
    seg_e = np.empty(expert_ids.shape[0], np.int64)
    seg_lo = np.empty(expert_ids.shape[0], np.int64)
    seg_hi = np.empty(expert_ids.shape[0], np.int64)
    r, S = 0, 0
    for b in range(expert_ids.shape[0]):
        e = expert_ids[b]
        if S == 0 or seg_e[S - 1] != e:
            seg_e[S], seg_lo[S] = e, r
            S += 1
        for i in range(b * block_m, (b + 1) * block_m):
            s = sorted_ids[i]
            if s < n_slots:
                slots[r] = s
                r += 1
        seg_hi[S - 1] = r
    return slots[:r], seg_e[:S], seg_lo[:S], seg_hi[:S]


def tile_rows(K: int, N: int) -> int:
    rows = max(16, min(256, SCRATCH_BYTES // (4 * K)))
    return min(N, rows)


def grouped_gemm(kern, wt, xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, N, path=None):
    """Run both paths over the segments: xg [R, K] gathered rows (natural order) -> out [n_slots, N]."""
    out = np.zeros((n_slots, N), np.float32)  # [T*A, N]
    lens = seg_hi - seg_lo
    small = lens <= DECODE_MAX_ROWS if path is None else np.full(lens.shape, path == "decode")
    xsum = group_sums(wt, xg) if small.any() else None  # [R, G]: the fused affine dot's offset term
    if kern.perm is not None:
        xg = np.ascontiguousarray(xg[:, kern.perm(xg.shape[1])])  # the order the decoder writes a row in
    if small.any():
        kern.gemv(wt, xg, xsum, seg_e[small], seg_lo[small], seg_hi[small], slots, scale, N, out)
    if (~small).any():
        K = xg.shape[1]
        tr = tile_rows(K, N)
        scratch = np.empty((tr, K), np.float32)  # the only decoded weights: <= SCRATCH_BYTES (or 16 rows)
        for e, lo, hi in zip(seg_e[~small], seg_lo[~small], seg_hi[~small]):
            xe = xg[lo:hi]  # [n_e, K]
            ye = np.empty((hi - lo, N), np.float32)  # [n_e, N]
            for n0 in range(0, N, tr):
                t = scratch[: min(tr, N - n0)]
                kern.decode_tile(wt, e, n0, t)
                ye[:, n0:n0 + t.shape[0]] = xe @ t.T
            out[slots[lo:hi]] = ye * scale[lo:hi, None]
    return out


def moe_gemm(x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights=None, x_is_slots=False, path=None):
    """``path``: None picks per expert (decode when it has <= DECODE_MAX_ROWS rows), or force 'decode'/'prefill'."""
    if w.shape[-1] != x.shape[-1]:
        raise ValueError(f"moe_gemm: x has K={x.shape[-1]} but weight {w.shape} has K={w.shape[-1]}")
    kern = kernel_for(w.fmt)
    n_slots = x.shape[0] if x_is_slots else x.shape[0] * top_k
    slots, seg_e, seg_lo, seg_hi = _segments(np.ascontiguousarray(sorted_ids, np.int32),
                                             np.ascontiguousarray(expert_ids, np.int32), block_m, n_slots)
    xa = act_dequant(np.ascontiguousarray(x, dtype=np.float32), w.fmt, "numba")
    xg = np.ascontiguousarray(xa[slots if x_is_slots else slots // top_k])  # [R, K]
    if topk_weights is None:
        scale = np.ones(slots.shape[0], np.float32)
    else:
        scale = np.ascontiguousarray(topk_weights, dtype=np.float32).reshape(-1)[slots]  # [R]
    return grouped_gemm(kern, kern.prepare(w), xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, w.shape[-2], path)
