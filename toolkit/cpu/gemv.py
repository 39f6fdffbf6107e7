"""The decode-path GEMV and the prefill tile decode of moe_gemm / qlinear, one template compiled per format.

Shapes: ``w`` a format's packed arrays (``toolkit/cpu/decoders.py``) of a stacked weight ``[E, N, K]``;
``x [R, K]`` f32 input rows in the kernel's order (``x[:, perm]``); ``X [R, G]`` their per-group sums
(natural order; the zero-point term); ``seg_e / seg_lo / seg_hi [S]`` segments of rows per expert;
``slot [R]`` output row and ``rscale [R]`` routing weight of each input row -> ``out [n_slots, N]``.

GEMV, per (segment, contiguous range of output rows) work item (``prange``; ranges are ``n_chunks``
equal, 4-aligned slices of N, one per thread):
  one input row (decode): 4 weight rows at a time share every activation load; per row two vector
      accumulators (even / odd planes) per group, then ``t = fma(a + b, splat(scale_g), t)``: one vector FMA
      per group and row, one horizontal sum per row; ``+ sum_g zero_g X_g`` as a vector dot over groups.
  2..8 input rows: one weight row at a time, each decoded step multiplied into up to 4 input rows.
  A step's planes come from the format's decoder (``DEC``), the scales from ``SCALE_AT`` (or, when one step
  spans ``SPLIT`` groups, per-lane scale vectors from ``SCALES_REP``); row tails beyond the last whole step
  (dense and per-row formats with K not a multiple of the step) are summed one code at a time.
Tile decode (prefill; serial: BLAS owns the threads): rows of ``tile [rows, K]`` <- ``code * scale + zero``
in the kernel's order, one vector FMA and store per plane.
On 16-lane builds ``WIDE()`` lets LLVM keep the 512-bit values in zmm registers (``toolkit/cpu/vec.py``).
Check: ``tests/test_moe_pipeline.py`` (against the NumPy references), ``tests/test_cpu_asm.py`` (the
emitted instructions); benchmark: ``python -m toolkit.bench moe --gemv``.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from ._jit import Kernel, twin, with_item
from .decoders import bind, packed
from .vec import add, fma, hsum, ops, prefetch, wide


@njit(cache=True)
def _nop():  # WIDE() on 8-lane builds
    pass


# ---- helpers (templates; bound per kernel with the decoder's functions and constants) --------------------
def _step(pl, x, off, a, b):
    """(a, b) + the planes of one step . x[off : off + C], even planes into a, odd into b."""
    for p in range(P):  # noqa: F821 (P: planes per step, a constant)
        if p % 2 == 0:
            a = fma(pl[p], LOAD(x, off + p * L), a)  # noqa: F821
        else:
            b = fma(pl[p], LOAD(x, off + p * L), b)  # noqa: F821
    return a, b


def _zero_dot(w, e, n, Xm):
    """sum_g zero_g * Xm[g] over the G groups of row n (0 for formats without zero points)."""
    if not HAS_ZERO:  # noqa: F821
        return np.float32(0.0)
    G = Xm.shape[0]
    acc = ZERO()  # noqa: F821
    g0 = 0
    while ZEROS_VEC and g0 + L <= G:  # noqa: F821 (ZEROS_VEC: the format loads L zero points as a vector)
        acc = fma(ZEROS(w, e, n, g0), LOAD(Xm, g0), acc)  # noqa: F821
        g0 += L  # noqa: F821
    t = hsum(acc)
    for gi in range(g0, G):
        t += ZERO_AT(w, e, n, gi) * Xm[gi]  # noqa: F821
    return t


def _zero_dot4(w, e, na, nb, nc, nd, Xm, y0, y1, y2, y3):
    """(y0..y3) + sum_g zero_g * Xm[g] for rows na..nd, one pass over the groups."""
    for gi in range(Xm.shape[0]):
        xg = Xm[gi]
        y0 += ZERO_AT(w, e, na, gi) * xg  # noqa: F821
        y1 += ZERO_AT(w, e, nb, gi) * xg  # noqa: F821
        y2 += ZERO_AT(w, e, nc, gi) * xg  # noqa: F821
        y3 += ZERO_AT(w, e, nd, gi) * xg  # noqa: F821
    return y0, y1, y2, y3


def _tail(w, e, n, x, k0, g):
    """The codes k0 .. K of row n (natural order) . x, one at a time."""
    t = np.float32(0.0)
    for k in range(k0, x.shape[0]):
        t += SCALE_AT(w, e, n, k // g) * CODE_AT(w, e, n, k) * x[k]  # noqa: F821
    return t


def _ahead(w, e, nd, pos, eps):
    """Prefetch the 4 rows after ``nd`` of the code array at element ``pos`` (the next call's rows: rows are
    read 4 at a time, which the hardware prefetcher follows poorly once the weights leave the cache)."""
    q = w[0]
    if (pos * q.itemsize) % 64 >= eps * q.itemsize:  # once per cache line
        return
    last = q.shape[1] - 1
    prefetch(q[e, min(nd + 1, last)], pos)
    prefetch(q[e, min(nd + 2, last)], pos)
    prefetch(q[e, min(nd + 3, last)], pos)
    prefetch(q[e, min(nd + 4, last)], pos)


def _dot4(w, e, na, nb, nc, nd, x, Xm):
    """Rows na..nd of expert e . x (one input row): 4 floats. One loop over the steps; the group's scale is
    applied when a group ends (every ``spg`` steps; every step when a step spans SPLIT groups), so a format
    whose group is one step (q4_0, q8_0) runs one flat loop, not a loop per group."""
    K = x.shape[0]
    G = GROUPS(w)  # noqa: F821
    g = K // G
    eps = max(1, w[0].shape[2] * C // K)  # noqa: F821 (code-array elements per step)
    spg = g // C if SPLIT == 1 else 1  # noqa: F821 (steps per group)
    n_steps = G * spg if SPLIT == 1 else K // C  # noqa: F821
    t0, t1, t2, t3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    a0, a1, a2, a3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    b0, b1, b2, b3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    cnt, gi = 0, 0
    for s in range(n_steps):
        off = s * C  # noqa: F821
        AHEAD(w, e, nd, s * eps, eps)  # noqa: F821
        a0, b0 = STEP(DEC(w, e, na, s), x, off, a0, b0)  # noqa: F821
        a1, b1 = STEP(DEC(w, e, nb, s), x, off, a1, b1)  # noqa: F821
        a2, b2 = STEP(DEC(w, e, nc, s), x, off, a2, b2)  # noqa: F821
        a3, b3 = STEP(DEC(w, e, nd, s), x, off, a3, b3)  # noqa: F821
        cnt += 1
        if cnt == spg:  # the end of a group (or of a split step): one vector FMA per row with its scale(s)
            if SPLIT == 1:  # noqa: F821
                t0 = fma(add(a0, b0), SPLAT(SCALE_AT(w, e, na, gi)), t0)  # noqa: F821
                t1 = fma(add(a1, b1), SPLAT(SCALE_AT(w, e, nb, gi)), t1)  # noqa: F821
                t2 = fma(add(a2, b2), SPLAT(SCALE_AT(w, e, nc, gi)), t2)  # noqa: F821
                t3 = fma(add(a3, b3), SPLAT(SCALE_AT(w, e, nd, gi)), t3)  # noqa: F821
            else:
                t0 = fma(add(a0, b0), SCALES_REP(w, e, na, s * SPLIT), t0)  # noqa: F821
                t1 = fma(add(a1, b1), SCALES_REP(w, e, nb, s * SPLIT), t1)  # noqa: F821
                t2 = fma(add(a2, b2), SCALES_REP(w, e, nc, s * SPLIT), t2)  # noqa: F821
                t3 = fma(add(a3, b3), SCALES_REP(w, e, nd, s * SPLIT), t3)  # noqa: F821
            a0, a1, a2, a3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
            b0, b1, b2, b3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
            cnt, gi = 0, gi + 1
    k0 = n_steps * C  # noqa: F821
    y0, y1, y2, y3 = hsum(t0), hsum(t1), hsum(t2), hsum(t3)
    if HAS_ZERO:  # noqa: F821 (a constant: the branch compiles away for formats without zero points)
        y0, y1, y2, y3 = ZERO_DOT4(w, e, na, nb, nc, nd, Xm, y0, y1, y2, y3)  # noqa: F821
    if k0 < K:  # row tails: only dense / per-row formats with K not a multiple of the step
        y0 += TAIL(w, e, na, x, k0, g)  # noqa: F821
        y1 += TAIL(w, e, nb, x, k0, g)  # noqa: F821
        y2 += TAIL(w, e, nc, x, k0, g)  # noqa: F821
        y3 += TAIL(w, e, nd, x, k0, g)  # noqa: F821
    return y0, y1, y2, y3


def _dot1(w, e, n, x):
    """Row n of expert e . x (one input row), for a decoder with one group per row and no zero points (the dense
    16-bit ones): two steps per iteration into four vector accumulators, one scale at the end."""
    K = x.shape[0]
    n_steps = K // C  # noqa: F821
    a, b, c, d = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    for s in range(0, n_steps - 1, 2):
        a, b = STEP(DEC(w, e, n, s), x, s * C, a, b)  # noqa: F821
        c, d = STEP(DEC(w, e, n, s + 1), x, (s + 1) * C, c, d)  # noqa: F821
    if n_steps % 2:
        a, b = STEP(DEC(w, e, n, n_steps - 1), x, (n_steps - 1) * C, a, b)  # noqa: F821
    k0 = n_steps * C  # noqa: F821
    y = hsum(add(add(a, b), add(c, d))) * SCALE_AT(w, e, n, 0)  # noqa: F821
    if k0 < K:
        y += TAIL(w, e, n, x, k0, K)  # noqa: F821
    return y


# The lane widths at which a ``row_by_row`` decoder reads its rows one after another: 8 (AVX2). At 16 (AVX-512) the
# 4 interleaved row streams are faster. Qwen3's 151936 x 2048 f16 head at one token, qlinear, each in one process
# against the streaming-read probe: 2-core AVX2 EPYC, 1 thread: row by row 26.2 GB/s, interleaved 15.0 (probe 21);
# 2-core AVX-512 Intel, interleaved 14.1-14.5 GB/s, row by row 10.3-10.5 (probe 16.2-16.6), and on 2 threads 28.5
# against 20.0-20.5 (probe 32).
ROW_BY_ROW_LANES = (8,)


def _dot4_rows(w, e, na, nb, nc, nd, x, Xm):
    """``DOT4`` of a ``row_by_row`` decoder: the 4 rows one after another, each read as one sequential stream."""
    return DOT1(w, e, na, x), DOT1(w, e, nb, x), DOT1(w, e, nc, x), DOT1(w, e, nd, x)  # noqa: F821


def _dot_cols(w, e, n, x0, x1, x2, x3):
    """Row n of expert e . 4 input rows (each decoded step used 4 times): 4 floats before zero terms."""
    K = x0.shape[0]
    G = GROUPS(w)  # noqa: F821
    g = K // G
    t0, t1, t2, t3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    spg = g // C if SPLIT == 1 else 1  # noqa: F821
    n_steps = G * spg if SPLIT == 1 else K // C  # noqa: F821
    a0, a1, a2, a3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    for s in range(n_steps):
        off = s * C  # noqa: F821
        pl = DEC(w, e, n, s)  # noqa: F821
        for p in range(P):  # noqa: F821
            v = pl[p]
            a0 = fma(v, LOAD(x0, off + p * L), a0)  # noqa: F821
            a1 = fma(v, LOAD(x1, off + p * L), a1)  # noqa: F821
            a2 = fma(v, LOAD(x2, off + p * L), a2)  # noqa: F821
            a3 = fma(v, LOAD(x3, off + p * L), a3)  # noqa: F821
        if SPLIT != 1 or (s + 1) % spg == 0:  # noqa: F821 (the end of a group, or of a split step)
            sv = SCALES_REP(w, e, n, s * SPLIT) if SPLIT != 1 else SPLAT(SCALE_AT(w, e, n, s // spg))  # noqa: F821
            t0, t1, t2, t3 = fma(a0, sv, t0), fma(a1, sv, t1), fma(a2, sv, t2), fma(a3, sv, t3)
            a0, a1, a2, a3 = ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
    k0 = n_steps * C  # noqa: F821
    return (hsum(t0) + TAIL(w, e, n, x0, k0, g), hsum(t1) + TAIL(w, e, n, x1, k0, g),  # noqa: F821
            hsum(t2) + TAIL(w, e, n, x2, k0, g), hsum(t3) + TAIL(w, e, n, x3, k0, g))  # noqa: F821


def _gemv(w, x, X, seg_e, seg_lo, seg_hi, slot, rscale, n_out, n_chunks, out):
    """Template: every segment's input rows against its expert's weight rows (see the module docstring), one
    work item (``ITEM``: ``_gemv_item``, compiled once and called by the serial and the parallel build) each."""
    WIDE()  # noqa: F821
    for it in prange(seg_e.shape[0] * n_chunks):
        ITEM(np.int64(it), w, x, X, seg_e, seg_lo, seg_hi, slot, rscale, n_out, n_chunks, out)  # noqa: F821


def _gemv_item(it, w, x, X, seg_e, seg_lo, seg_hi, slot, rscale, n_out, n_chunks, out):
    """Template: work item ``it`` of ``_gemv``: segment ``it // n_chunks``, output-row range ``it % n_chunks``."""
    WIDE()  # noqa: F821
    sg, c = it // n_chunks, it % n_chunks
    e, lo, hi = seg_e[sg], seg_lo[sg], seg_hi[sg]
    n0 = n_out * c // n_chunks // 4 * 4
    n1 = n_out if c == n_chunks - 1 else n_out * (c + 1) // n_chunks // 4 * 4
    if hi - lo == 1:
        xm, Xm, o, rs = x[lo], X[lo], out[slot[lo]], rscale[lo]
        for n in range(n0, n1, 4):
            last = n1 - 1
            y = DOT4(w, e, n, min(n + 1, last), min(n + 2, last), min(n + 3, last), xm, Xm)  # noqa: F821
            for r in range(min(4, n1 - n)):
                o[n + r] = y[r] * rs
    else:
        for m in range(lo, hi, 4):
            ma, mb, mc, md = m, min(m + 1, hi - 1), min(m + 2, hi - 1), min(m + 3, hi - 1)
            for n in range(n0, n1):
                y = DOT_COLS(w, e, n, x[ma], x[mb], x[mc], x[md])  # noqa: F821
                ms = (ma, mb, mc, md)
                for r in range(min(4, hi - m)):
                    mr = ms[r]
                    out[slot[mr], n] = (y[r] + ZERO_DOT(w, e, n, X[mr])) * rscale[mr]  # noqa: F821


def _decode_tile(w, e, n0, tile):
    """Template: tile [rows, K] <- rows n0.. of expert e, dequantized, in the kernel's order."""
    WIDE()  # noqa: F821
    K = tile.shape[1]
    G = GROUPS(w)  # noqa: F821
    g = K // G
    spg = g // C if SPLIT == 1 else 1  # noqa: F821
    n_steps = G * spg if SPLIT == 1 else K // C  # noqa: F821
    for r in range(tile.shape[0]):
        n, row = n0 + r, tile[r]
        for s in range(n_steps):
            if SPLIT == 1:  # noqa: F821
                sv, zv = SPLAT(SCALE_AT(w, e, n, s // spg)), SPLAT(ZERO_AT(w, e, n, s // spg))  # noqa: F821
            else:
                sv, zv = SCALES_REP(w, e, n, s * SPLIT), ZEROS_REP(w, e, n, s * SPLIT)  # noqa: F821
            pl = DEC(w, e, n, s)  # noqa: F821
            for p in range(P):  # noqa: F821
                STORE(row, s * C + p * L, fma(pl[p], sv, zv))  # noqa: F821
        for k in range(n_steps * C, K):  # noqa: F821
            row[k] = CODE_AT(w, e, n, k) * SCALE_AT(w, e, n, k // g) + ZERO_AT(w, e, n, k // g)  # noqa: F821


@functools.cache
def compiled(dec, L: int, split: int) -> tuple:
    """(GEMV Kernel pair, tile decoder) of one decoder at L lanes and ``split`` groups per step."""
    both, suffix = _bindings(dec, L, split)
    outer, _ = with_item(_gemv, _gemv_item, suffix, {"fastmath": True}, **both)  # int3-g32's pair: 12.4 -> 7.4 s cold
    return (Kernel(outer, fastmath=True),
            njit(cache=True)(twin(_decode_tile, suffix, **both)))


def _bindings(dec, L: int, split: int) -> tuple[dict, str]:
    """The constants and inlined helpers a kernel template is bound with, and the kernel name suffix."""
    f, o = bind(dec, L, split), ops(L)
    consts = dict(L=L, C=dec.planes * L, P=dec.planes, SPLIT=split, HAS_ZERO=dec.has_zero, ZEROS_VEC=dec.zero_vec,
                  LOAD=o["load"],
                  STORE=o["store"], ZERO=o["zero"], SPLAT=o["splat"], WIDE=wide if L == 16 else _nop,
                  DEC=f["dec"], CODE_AT=f["code_at"], GROUPS=f["groups"], SCALE_AT=f["scale_at"],
                  SCALES_REP=f["scales_rep"], ZERO_AT=f["zero_at"], ZEROS=f["zeros"], ZEROS_REP=f["zeros_rep"])
    suffix = f"__{dec.name}_L{L}_s{split}"
    inline = njit(cache=True, inline="always")
    helpers = {}
    for name, fn in (("STEP", _step), ("AHEAD", _ahead), ("ZERO_DOT4", _zero_dot4)):
        helpers[name] = inline(twin(fn, suffix, **consts))
    for name, fn in (("ZERO_DOT", _zero_dot), ("TAIL", _tail)):  # once per row, not per step: called, not
        helpers[name] = njit(cache=True)(twin(fn, suffix, **consts))  # inlined (8 inlined copies cost compile time)
    both = {**consts, **helpers}
    if dec.row_by_row and L in ROW_BY_ROW_LANES:
        both["DOT1"] = inline(twin(_dot1, suffix, **both))
        both["DOT4"] = inline(twin(_dot4_rows, suffix, **both))
    else:
        both["DOT4"] = inline(twin(_dot4, suffix, **both))
    both["DOT_COLS"] = inline(twin(_dot_cols, suffix, **both))
    return both, suffix


def assembly(spec: str, L: int | None = None) -> str:
    """The GEMV work item's assembly (``_gemv_item``: the loops) for format ``spec`` at ``L`` lanes (default: the host's widest), from an
    uncached build (Numba cannot inspect code loaded from its disk cache). For the assembly test."""
    from ..formats import get_format
    from .decoders import decoder_for
    from .vec import max_lanes

    fmt = get_format(spec)
    L = L or max_lanes()
    dec = decoder_for(fmt)
    w = fmt.quantize(np.linspace(-1, 1, 8 * 256, dtype=np.float32).reshape(1, 8, 256), "numpy")
    _, split = dec.steps(L, dec.group(w))
    both, suffix = _bindings(dec, L, split)
    outer, item = with_item(_gemv, _gemv_item, suffix + "__asm", {"fastmath": True}, cache=False, **both)
    fn = njit(cache=False, fastmath=True)(outer)
    arrays = packed(w, dec)
    p = dec.perm(256, L)
    x = np.ones((1, 256), np.float32)[:, p] if p is not None else np.ones((1, 256), np.float32)
    i64 = np.zeros(1, np.int64)
    fn(arrays, np.ascontiguousarray(x), np.ones((1, 256 // dec.group(w)), np.float32), i64, i64, i64 + 1, i64,
       np.ones(1, np.float32), 8, 1, np.zeros((1, 8), np.float32))
    return item.inspect_asm(item.signatures[0])
