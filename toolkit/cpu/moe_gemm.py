"""moe_gemm (Numba): grouped GEMM over the M-blocks of a moe_align layout, dequantization fused in.

Shapes: ``x [T, K]`` (GEMM1) or ``[T*A, K]`` (GEMM2, ``x_is_slots``); ``w`` QTensor ``[E, N, K]`` in any
registry format; ``sorted_ids [P]``, ``expert_ids [P / block_m]`` -> ``out f32 [T*A, N]`` (spec:
``toolkit/ref/moe_gemm.py``). The blocks are first compacted into per-expert segments of real slots
(``seg_e / seg_lo / seg_hi`` over ``xg [R, K]``, the gathered input rows; ``R`` routed slots).

Each format has a CPU decoder (``decoder_for(fmt)``, by the record's ``cpu_decoder``, in ``toolkit/cpu/decoders.py``): a private packed
layout made once per weight (``prepare``, cached per QTensor) and a step decoder bound into the kernel
templates of ``toolkit/cpu/gemv.py``, compiled per format (and lane count) only when used and cached on disk
under its own name; no kernel source is copied per bit width:
  decode path (segments of <= ``DECODE_MAX_ROWS`` rows; GEMV-like): explicit-SIMD GEMV over (segment,
      contiguous range of output rows per thread), ``prange`` when the work pays for the threads
      (``toolkit/cpu/_jit.py``); 4 weight rows share each activation load, scales applied as one vector FMA
      per group, one horizontal sum per row; never a decoded scratch row.
  prefill path (longer segments; compute-bound): for each expert and tile of ``tile`` output rows, the
      tile is decoded into an f32 scratch of at most ``SCRATCH_BYTES`` and the expert's gathered rows are
      multiplied by it with NumPy's BLAS (``x_e @ tile.T``); on more threads, each Python thread takes every n-th
      tile with its own scratch and one BLAS thread, so decodes and products overlap (``tiles_times``). A 16-bit
      weight's segments skip the tiles: ``toolkit/cpu/gemm16.py`` multiplies its stored bits (``segment_times``).
Both read the input rows in the decoder's order (``x[:, perm]``, once per call).
No dequantized copy of a whole expert ever exists.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
from numba import njit

from ..formats.base import QTensor
from ..formats.mixed import MixedExperts
from ..threads import blas_for, threads, xwt
from .decoders import decoder_for, keep_packed_only, packed
from ..formats.int_form import QK, supported as igemm_supports
from . import gemm16, igemm, igemm_pack
from .gemv import compiled
from .vec import max_lanes

DECODE_MAX_ROWS = 8  # rows per expert up to which the GEMV path wins, on one thread
# With more threads the GEMV path splits its (segment, row block) items over them and the tiled path's weight
# decode runs serially: a Mixtral-shaped layer's 64-token prompt (16 rows per expert), q4_0, in one run: 2 threads
# 80-83 tok/s on the GEMV path against 33-44 tiled; 1 thread 40-42 against 44-49.
DECODE_MAX_ROWS_PARALLEL = 64


def decode_max_rows(widening: bool = False) -> int:
    """Rows per expert up to which a segment takes the GEMV path at the configured thread count. A weight whose
    tile decode only widens (``widening``: a 16-bit dense weight, attention's projections or the LM head) takes
    the prefill path from ``DECODE_MAX_ROWS`` on at any thread count, where 16-bit ones run gemm16 over both threads
    (Mixtral's o projection, f16, 64 rows, 2 threads: GEMV path 54 ms, tiled 22 ms, gemm16 11-14 ms)."""
    return DECODE_MAX_ROWS if threads() == 1 or widening else DECODE_MAX_ROWS_PARALLEL


# prefill tile scratch bound: 256 rows at K = 4096, where OpenBLAS splits a 64-token product over 2 threads
# (measured, 64 x 4096 @ 4096 x rows: 64 rows 64 GFLOP/s on 2 threads, no faster than 1; 256 rows 140)
SCRATCH_BYTES = 4 << 20
LANES = None  # SIMD lanes of the kernels: None = the widest the target has (16 with AVX-512, else 8)
# "int8" (the default, as llama.cpp's q8 activations): the activations of the expert GEMMs of int8 / int4 / int3 /
# int2 / q8_0 / q4_0 weights quantized once per token to 8-bit blocks of 32 along K, then integer dot products
# (``toolkit/cpu/igemm.py``, spec ``toolkit/ref/igemm.py``) at decode and prefill alike; those weights are packed in
# the integer kernels' layout only. "f32" (``--activations f32``): exact f32 activations everywhere, the weights in
# the f32 kernels' layout. The kind is chosen where a layer is built: ``prepare_weight(w, kind)`` (the load, through
# ``Runtime(backend, activations)``) packs a weight for it and records it on the weight, and every kernel reads the
# weight's kind. A weight never prepared takes the exact f32 path (what the reference computes). fp8 keeps its own
# W8A8 scheme; formats without an integer form always take the f32 path.
ACTIVATION_KINDS = ("f32", "int8")
DEFAULT_ACTIVATIONS = "int8"  # what a model load takes when the caller names no kind (load_model, the CLI, the app)
_KINDS: dict[int, str] = {}  # id(weight) -> the activation kind it was prepared for (kept while the weight lives)


def check_activations(kind: str | None) -> str:
    """``kind`` (None: ``DEFAULT_ACTIVATIONS``), checked: ValueError naming the kinds otherwise."""
    kind = DEFAULT_ACTIVATIONS if kind is None else kind
    if kind not in ACTIVATION_KINDS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_KINDS)}, got {kind!r}")
    return kind


def parse_activations(text: str) -> tuple[str, ...]:
    """A comma-separated list of activation kinds ("int8,f32") -> the kinds, in order; ValueError naming a bad one."""
    kinds = tuple(k for k in text.split(",") if k)
    for k in kinds:
        if k not in ACTIVATION_KINDS:
            raise ValueError(f"--activations: {k!r} is not one of {', '.join(ACTIVATION_KINDS)}")
    return kinds


def prepared_kind(w) -> str | None:
    """The activation kind ``w`` was prepared for (:func:`prepare_weight`), or None."""
    return _KINDS.get(id(w))


def mark_activations(w, kind: str) -> None:
    """Record that the kernels run ``w`` on ``kind`` activations (its packing is made at its first call)."""
    if id(w) not in _KINDS:
        weakref.finalize(w, _KINDS.pop, id(w), None)
    _KINDS[id(w)] = kind


class Prepared:
    """One weight made ready for the kernels: its packed arrays, lane count and the kernels compiled for them."""

    def __init__(self, dec, qt):
        self.arrays = packed(qt, dec)  # the packed layout (decoders.py)
        self.dec, self.K = dec, qt.shape[-1]
        self.G = qt.shape[-1] // dec.group(qt)  # scale groups per row
        self.L = LANES or max_lanes()
        _, self.split = dec.steps(self.L, dec.group(qt))
        self.gemv_kernel, self.tile_kernel = compiled(dec, self.L, self.split)
        p = dec.perm(self.K, self.L)
        self.perm = None if p is None or (p == np.arange(self.K)).all() else p  # [K] x order of the kernels


class _Kernel:
    """A format's decoder: ``prepare`` (once per weight, cached), the GEMV and the tile decode."""

    def __init__(self, fmt):
        self.dec = decoder_for(fmt)
        if self.dec is None:
            raise NotImplementedError(f"moe_gemm: no Numba decoder for format {fmt.spec!r} (cpu_decoder {fmt.cpu_decoder!r})")
        self.widening = not fmt.quantized  # a 16-bit dense weight: its tile decode only widens (decode_max_rows)

    def prepare(self, qt) -> Prepared:
        return packed(qt, self.dec, key=("prepared", self.dec.name, LANES), pack=lambda q: Prepared(self.dec, q))

    def gemv(self, wt: Prepared, xg, xsum, seg_e, seg_lo, seg_hi, slot, scale, n_out, out):
        work = slot.shape[0] * n_out * xg.shape[1]  # multiply-adds (at most: every routed row in a segment)
        wt.gemv_kernel(work, wt.arrays, xg, xsum, seg_e, seg_lo, seg_hi, slot, scale, n_out, threads(), out)

    def decode_tile(self, wt: Prepared, e, n0, tile):
        wt.tile_kernel(wt.arrays, e, n0, tile)


_KERNELS: dict[str, _Kernel] = {}


def prepare_weight(w, activations: str | None = None):
    """A loaded weight for expert GEMMs on ``activations`` (None: ``DEFAULT_ACTIVATIONS``), the kind recorded on
    it and its kernels' packed layout made now (cached on it) for a quantized one with a decoder: at load, so that
    what it replaces goes as each weight arrives (mapped pages handed back; a copy quantized here dropped where
    the packing rebuilds it exactly). Returns ``w``."""
    kind = check_activations(activations)
    for qt in [g.weight for g in w.groups] if isinstance(w, MixedExperts) else [w]:
        if not isinstance(qt, QTensor) or len(qt.shape) < 2:
            continue
        mark_activations(qt, kind)
        if int8_applies(qt):  # the integer kernels' layout only: the f32 GEMV's is never made for it
            igemm_pack.packed(qt)
            keep_packed_only(qt, igemm_pack.KEY, igemm_pack.unpack)
        elif decoder_for(qt.fmt) is not None:
            kern = kernel_for(qt.fmt)
            kern.prepare(qt)
            keep_packed_only(qt, kern.dec.name, kern.dec.unpack)  # quantized here: the stored copy dropped
    return w


def kernel_for(fmt) -> _Kernel:
    if fmt.name not in _KERNELS:  # the group size is a run-time value: int4-g32 and int4-g128 share a decoder
        _KERNELS[fmt.name] = _Kernel(fmt)
    return _KERNELS[fmt.name]


@njit(cache=True)
def _group_sums(x, G):
    R, K = x.shape
    g = K // G
    X = np.empty((R, G), np.float32)
    for r in range(R):
        for gi in range(G):
            s = np.float32(0.0)
            for k in range(gi * g, gi * g + g):
                s += x[r, k]
            X[r, gi] = s
    return X


def group_sums(x: np.ndarray, G: int) -> np.ndarray:
    """x [R, K] in natural order -> [R, G]: the sum of each scale group (the zero-point term's factor), in order
    (the compiled decode step sums them with this same function: the same bits)."""
    return _group_sums(np.ascontiguousarray(x, np.float32), G)


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


def int8_applies(w, activations=None) -> bool:
    """Whether the expert GEMMs of weight ``w`` run on int8 activations: ``activations`` when given, else the kind
    ``w`` was prepared for (a weight never prepared: f32)."""
    kind = activations or prepared_kind(w) or "f32"
    return kind == "int8" and igemm_supports(w.fmt) and w.shape[-1] % QK == 0


def kernel_rows(wt, xg, with_sums: bool = True):
    """(xsum [R, G], xg in the kernels' order) for gathered rows ``xg [R, K]`` (natural order). The group sums
    (the zero-point term's factor) are computed only for formats with zero points; others get zeros [R, 1]."""
    xsum = group_sums(xg, wt.G) if with_sums and wt.dec.has_zero else np.zeros((xg.shape[0], 1), np.float32)
    if wt.perm is not None:
        xg = np.ascontiguousarray(xg[:, wt.perm])  # the order the kernels read a row in
    return xsum, xg


def decode_gemv(kern, wt, xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, N):
    """The GEMV path alone (every segment short: a decode step): the few NumPy steps it needs, nothing else
    (a decode step runs this ~10 times per layer, so its fixed cost is a visible part of the step)."""
    out = np.zeros((n_slots, N), np.float32)  # [T*A, N]
    xsum, xg = kernel_rows(wt, xg)
    kern.gemv(wt, xg, xsum, seg_e, seg_lo, seg_hi, slots, scale, N, out)
    return out


def grouped_gemm(kern, wt, xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, N, path=None):
    """Run both paths over the segments: xg [R, K] gathered rows (natural order) -> out [n_slots, N]."""
    limit = decode_max_rows(kern.widening)
    if path == "decode" or (path is None and xg.shape[0] <= limit):
        return decode_gemv(kern, wt, xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, N)
    out = np.zeros((n_slots, N), np.float32)  # [T*A, N]
    lens = seg_hi - seg_lo
    small = lens <= limit if path is None else np.full(lens.shape, path == "decode")
    large = ~small
    xsum, xg = kernel_rows(wt, xg, with_sums=bool(small.any()))
    if small.any():
        kern.gemv(wt, xg, xsum, seg_e[small], seg_lo[small], seg_hi[small], slots, scale, N, out)
    if large.any():
        tr = tile_rows(xg.shape[1], N)
        for e, lo, hi in zip(seg_e[large], seg_lo[large], seg_hi[large]):
            ye = segment_times(kern, wt, e, xg[lo:hi], N, tr)  # [n_e, N]
            out[slots[lo:hi]] = ye * scale[lo:hi, None]
    return out


def segment_times(kern, wt, e, xe, N: int, tr: int) -> np.ndarray:
    """``xe [n, K]`` times expert ``e``'s rows, transposed -> ``[n, N]``: a 16-bit weight straight from its bits
    (``toolkit/cpu/gemm16.py``), any other tile by tile (``tiles_times``)."""
    if kern.dec.name in gemm16.KINDS and gemm16.applies(xe.shape[1], wt.L):
        assert wt.perm is None, "a 16-bit weight's rows are read in natural order"
        return gemm16.gemm16(xe, wt.arrays[0][e], kern.dec.name, wt.L)
    return tiles_times(kern, wt, e, xe, N, tr)


def tiles_times(kern, wt, e, xe, N: int, tr: int) -> np.ndarray:
    """``xe [n, K]`` times expert ``e``'s rows, transposed -> ``[n, N]``: tile by tile, each tile of ``tr`` rows
    decoded into a scratch (the only decoded weights: <= SCRATCH_BYTES, or 16 rows) and multiplied by BLAS.

    On more than one thread, with tiles enough, each of ``threads()`` Python threads takes every n-th tile with its
    own scratch and BLAS on one thread: one decodes a tile (Numba, holding Python's GIL) while another multiplies
    (BLAS lets the GIL go). With one thread decoding and BLAS owning both, the second core idled through every
    decode: Mixtral's 16-bit q/k/v at 64 rows, 2 threads, 24.8 -> 16.7 ms (o 15.1 -> 10.9), interleaved in one
    process. Every element is the same dot product either way (BLAS splits rows and columns, never K): the bits of
    one thread."""
    K = xe.shape[1]
    starts = list(range(0, N, tr))
    n_workers = min(threads(), len(starts) // 2)
    ye = np.empty((xe.shape[0], N), np.float32)  # [n, N]

    def run(mine):
        scratch = np.empty((tr, K), np.float32)
        for n0 in mine:
            t = scratch[: min(tr, N - n0)]
            kern.decode_tile(wt, e, n0, t)
            ye[:, n0:n0 + t.shape[0]] = xwt(xe, t)

    if n_workers < 2:
        run(starts)
        return ye
    blas_for(0)  # one BLAS thread per worker
    errors = []

    def guarded(mine):
        try:
            run(mine)
        except BaseException as err:  # noqa: BLE001 (raised again in the caller below)
            errors.append(err)

    others = [threading.Thread(target=guarded, args=(starts[i::n_workers],), daemon=True) for i in range(1, n_workers)]
    for t in others:  # a thread per call (~0.1 ms against a tile's milliseconds): nothing kept that a fork could break
        t.start()
    guarded(starts[0::n_workers])
    for t in others:
        t.join()
    if errors:
        raise errors[0]
    return ye


_ROWS = {n: (np.arange(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64)) for n in range(1, 17)}


def expert_rows(x, w, experts, scale, activations=None):
    """The decode step's GEMV without alignment: row a of ``x [A, K]`` times expert ``experts[a]`` of
    ``w [E, N, K]``, scaled by ``scale[a]`` -> ``[A, N]``. Equal to moe_gemm on one token's A slots
    (``x_is_slots``) with distinct experts; weight-only formats (W8A8 goes through moe_gemm)."""
    A = x.shape[0]
    lo, hi = _ROWS[A] if A in _ROWS else (np.arange(A, dtype=np.int64), np.arange(1, A + 1, dtype=np.int64))
    experts = np.ascontiguousarray(experts, np.int64)
    if int8_applies(w, activations):
        return igemm.grouped_igemm(w, x, lo, experts, lo, hi, scale, A)
    kern = kernel_for(w.fmt)
    return decode_gemv(kern, kern.prepare(w), np.ascontiguousarray(x, np.float32), lo, experts, lo, hi, scale, A,
                       w.shape[-2])


def moe_gemm(x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights=None, x_is_slots=False, path=None,
             activations=None):
    """``path``: None picks per expert (decode when it has <= ``decode_max_rows()`` rows), or force 'decode'/'prefill'.
    ``activations``: 'f32' or 'int8' (the integer formats' int8-activation path; None: the weight's kind)."""
    if w.shape[-1] != x.shape[-1]:
        raise ValueError(f"moe_gemm: x has K={x.shape[-1]} but weight {w.shape} has K={w.shape[-1]}")
    n_slots = x.shape[0] if x_is_slots else x.shape[0] * top_k
    slots, seg_e, seg_lo, seg_hi = _segments(np.ascontiguousarray(sorted_ids, np.int32),
                                             np.ascontiguousarray(expert_ids, np.int32), block_m, n_slots)
    xa = w.fmt.act_dequant(np.ascontiguousarray(x, dtype=np.float32), "numba")
    rows = slots if x_is_slots else slots // top_k  # [R]: the input row of each routed slot
    if topk_weights is None:
        scale = np.ones(slots.shape[0], np.float32)
    else:
        scale = np.ascontiguousarray(topk_weights, dtype=np.float32).reshape(-1)[slots]  # [R]
    if int8_applies(w, activations):  # each token quantized once, however many experts it is routed to
        return igemm.moe_igemm(w, igemm.quantize_act(xa), rows, slots, seg_e, seg_lo, seg_hi, scale, n_slots)
    kern = kernel_for(w.fmt)
    xg = np.ascontiguousarray(xa[rows])  # [R, K] (the f32 paths read gathered rows)
    return grouped_gemm(kern, kern.prepare(w), xg, slots, seg_e, seg_lo, seg_hi, scale, n_slots, w.shape[-2], path)
