"""kv_attention (Numba): GQA causal attention reading the cache in its stored format, in blocks of keys.

One parallel iteration per (sequence, KV head, tile of query tokens); its rows are the tile's queries times the
``H / Hkv`` query heads sharing the KV head (decode: one token, ``rep`` rows; prefill: up to ``ROWS`` rows), so
each cached key block is decoded once per step for all of them. The keys the tile can see are walked in blocks
of ``KEYS``: the K and V rows of a block are decoded once into f32 tiles in L1 (scales applied; an f32 cache is
read in place) by the row codecs of :mod:`toolkit.cpu.kv_codecs`, bound per (K format, V format) pair; then, per
query row, the block's scores q.K (vectorised dot products), its max, one rescale of the accumulators when the
max grew (online softmax per block, not per key), the probabilities by a vectorised exp, and acc += P.V.
Each row sees only its own keys (causal, sliding window, per-sequence positions); f32 accumulators throughout.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._jit import Kernel, with_item
from .kv_codecs import I32, I64, LANES, ROW_CODECS, load, splat, store, vec, view

ROWS = 32  # query rows (query tokens x heads per KV head) per parallel iteration in prefill
KEYS = 64  # keys per block (half that for head dims over 64)


@intrinsic
def _f32_from_bits(typingctx, x):  # the low 32 bits of an integer -> f32 (a bitcast, which LLVM vectorises)
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if x.bitwidth > 32 else args[0], ir.FloatType())

    if isinstance(x, types.Integer) and x.bitwidth >= 32:
        return types.float32(x), codegen
    return None


# exp on x <= 0 (s - max), f32 to ~1 ulp (Cephes expf: Cody-Waite reduction, degree-5 polynomial, 2^n from its
# exponent bits); a plain function LLVM inlines and vectorises over a block (no vector libm in Numba). Compiled
# without `reassoc`, which would fold the two-part reduction back into one product.
@njit(cache=True, fastmath={"contract", "nsz"})
def exp_nonpos(x):
    x = max(x, np.float32(-87.0))  # below: 2^n underflows; exp(-87) ~ 1.6e-38 is 0 for the softmax
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


# ---- the block's two products in LLVM vector IR (LANES f32 lanes): LLVM's own vectoriser leaves a horizontal
# sum per dot product and reloads the accumulator row for every key -----------------------------------------------
def _shuf(b, x, y, idx):
    return b.shuffle_vector(x, y, ir.Constant(vec(len(idx), I32), idx))


def _fma(b, x, y, z):  # x * y + z, fused
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(x.type, [x.type] * 3), f"llvm.fma.v{LANES}f32")
    return b.call(fn, [x, y, z])


def _sums(b, v):
    """LANES vectors -> the vector of their LANES sums: a transposing tree (log2 LANES levels of pairwise adds)."""
    W, h = LANES, 1
    while len(v) > 1:
        lo = [i // (2 * h) * 2 * h + i % (2 * h) + (0 if i % (2 * h) < h else W - h) for i in range(W)]
        v = [b.fadd(_shuf(b, x, y, lo), _shuf(b, x, y, [i + h for i in lo]))
             for x, y in zip(v[::2], v[1::2])]
        h *= 2
    return v[0]


def _fold(b, v, op):  # one vector -> op over its lanes
    h = LANES // 2
    while h:
        v = op(v, _shuf(b, v, v, [i ^ h for i in range(LANES)]))
        h //= 2
    return b.extract_element(v, I32(0))


def _max(b, x, y):
    return b.select(b.fcmp_ordered(">", x, y), x, y)


def _f32(*tys) -> bool:
    return all(isinstance(t, types.Array) and t.dtype == types.float32 and t.layout == "C" for t in tys)


def _ints(context, b, sig, args, *idx):  # integer arguments as i64
    return [context.cast(b, args[i], sig.args[i], types.int64) for i in idx]


def _typed(arrays, ints) -> bool:
    return (all(isinstance(t, types.Array) and t.dtype == types.float32 and t.layout == "C" for t in arrays)
            and all(isinstance(t, types.Integer) for t in ints))


@intrinsic
def block_scores(typingctx, q, r, k, a, n, out):
    """``out[j] = q[r] . k[a + j]`` for ``j < n`` (head dim a multiple of LANES), LANES keys at a time (one
    accumulator each, reduced together by :func:`_sums`); returns ``max(out[:n])``."""
    def codegen(context, b, sig, args):
        W, V = LANES, vec(LANES)
        qp, (_, hd), (qs, _) = view(context, b, sig.args[0], args[0])
        kp, _, (ks, _) = view(context, b, sig.args[2], args[2])
        op = view(context, b, sig.args[5], args[5])[0]
        r, a, n = _ints(context, b, sig, args, 1, 3, 4)
        qp, kp = b.gep(qp, [b.mul(r, qs)]), b.gep(kp, [b.mul(a, ks)])
        zero = ir.Constant(V, [0.0] * W)
        acc = [cgutils.alloca_once_value(b, zero) for _ in range(W)]
        best = cgutils.alloca_once_value(b, ir.Constant(V, [float("-inf")] * W))
        nch, ng = b.sdiv(hd, I64(W)), b.sdiv(n, I64(W))
        with cgutils.for_range(b, ng) as g:
            rows = [b.mul(b.add(b.mul(g.index, I64(W)), I64(i)), ks) for i in range(W)]
            for x in acc:
                b.store(zero, x)
            with cgutils.for_range(b, nch) as c:
                off = b.mul(c.index, I64(W))
                qv = load(b, qp, off, V)
                for i in range(W):
                    b.store(_fma(b, qv, load(b, kp, b.add(rows[i], off), V), b.load(acc[i])), acc[i])
            sums = _sums(b, [b.load(x) for x in acc])
            store(b, sums, op, b.mul(g.index, I64(W)))
            b.store(_max(b, sums, b.load(best)), best)
        top = cgutils.alloca_once_value(b, _fold(b, b.load(best), lambda x, y: _max(b, x, y)))
        with cgutils.for_range(b, n, start=b.mul(ng, I64(W))) as j:  # the last n % LANES keys, one at a time
            b.store(zero, acc[0])
            with cgutils.for_range(b, nch) as c:
                off = b.mul(c.index, I64(W))
                kv = load(b, kp, b.add(b.mul(j.index, ks), off), V)
                b.store(_fma(b, load(b, qp, off, V), kv, b.load(acc[0])), acc[0])
            x = _fold(b, b.load(acc[0]), b.fadd)
            b.store(x, b.gep(op, [j.index]))
            b.store(_max(b, x, b.load(top)), top)
        return b.load(top)

    return (types.float32(q, r, k, a, n, out), codegen) if _typed((q, k, out), (r, a, n)) else None


@intrinsic
def block_pv(typingctx, acc, r, p, v, a, n):
    """``acc[r] += sum_j p[j] * v[a + j]`` for ``j < n`` (head dim a multiple of LANES). The accumulator row stays
    in registers across the keys: passes over w <= 4 chunks of LANES lanes, the keys in 8 / w interleaved
    streams (8 independent FMA chains), summed at the end of the pass."""
    def codegen(context, b, sig, args):
        W, V = LANES, vec(LANES)
        ap, (_, hd), (As, _) = view(context, b, sig.args[0], args[0])
        pp = view(context, b, sig.args[2], args[2])[0]
        vp, _, (vs, _) = view(context, b, sig.args[3], args[3])
        r, a, n = _ints(context, b, sig, args, 1, 4, 5)
        ap, vp = b.gep(ap, [b.mul(r, As)]), b.gep(vp, [b.mul(a, vs)])
        zero = ir.Constant(V, [0.0] * W)
        regs = [cgutils.alloca_once_value(b, zero) for _ in range(8)]

        def key(j, d0, w, u):  # stream u += p[j] * v[j, d0 : d0 + w * W]
            pj, row = splat(b, b.load(b.gep(pp, [j])), W), b.add(b.mul(j, vs), d0)
            for i in range(w):
                x = regs[u * w + i]
                b.store(_fma(b, pj, load(b, vp, b.add(row, I64(W * i)), V), b.load(x)), x)

        def one_pass(d0, w):  # lanes d0 .. d0 + w * W of the row
            streams = 8 // w
            for i in range(w * streams):
                b.store(load(b, ap, b.add(d0, I64(W * i)), V) if i < w else zero, regs[i])
            with cgutils.for_range(b, b.sdiv(n, I64(streams))) as jj:
                for u in range(streams):
                    key(b.add(b.mul(jj.index, I64(streams)), I64(u)), d0, w, u)
            with cgutils.for_range(b, n, start=b.mul(b.sdiv(n, I64(streams)), I64(streams))) as j:
                key(j.index, d0, w, 0)
            for i in range(w):
                x = b.load(regs[i])
                for u in range(1, streams):
                    x = b.fadd(x, b.load(regs[u * w + i]))
                store(b, x, ap, b.add(d0, I64(W * i)))

        with cgutils.for_range(b, b.sdiv(hd, I64(4 * W))) as blk:
            one_pass(b.mul(blk.index, I64(4 * W)), 4)
        rest = b.srem(hd, I64(4 * W))  # 0 .. 3 chunks left
        with b.if_then(b.icmp_signed(">=", rest, I64(2 * W))):
            one_pass(b.sub(hd, rest), 2)
        with b.if_then(b.icmp_signed("!=", b.srem(rest, I64(2 * W)), I64(0))):
            one_pass(b.sub(hd, I64(W)), 1)
        return context.get_dummy_value()

    return (types.void(acc, r, p, v, a, n), codegen) if _typed((acc, p, v), (r, a, n)) else None


@njit(cache=True)
def tiling(T, rep):
    """(query tokens per tile, tiles) of T tokens with ``rep`` query heads per KV head."""
    qt = max(1, min(T, ROWS // rep))
    return qt, (T + qt - 1) // qt


def _kv_attention(q, k, v, positions, scale, window, sinks, out):
    """Template: one work item (``ITEM``: ``_kv_attention_item``, compiled once for the serial and the parallel
    build) per (sequence, KV head, tile of query tokens), numbered contiguously: a thread's tiles share their
    sequence and KV head."""
    for idx in prange(q.shape[0] * k.shape[1] * tiling(q.shape[1], q.shape[2] // k.shape[1])[1]):
        ITEM(np.int64(idx), q, k, v, positions, scale, window, sinks, out)  # noqa: F821


def _kv_attention_item(idx, q, k, v, positions, scale, window, sinks, out):
    """Template: work item ``idx`` of ``_kv_attention``."""
    B, T, H, hd = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    keys = KEYS if hd <= 64 else KEYS // 2  # keys per block: decoded K and V tiles stay within L1
    qt, tiles = tiling(T, rep)  # query tokens per tile
    simd = hd % LANES == 0  # else plain loops (f32 caches of small head dims)
    b = idx // (Hkv * tiles)
    kh = (idx // tiles) % Hkv
    t0 = (idx % tiles) * qt
    nr = (min(T, t0 + qt) - t0) * rep
    qs = np.empty((nr, hd), np.float32)  # the rows' queries, pre-scaled
    lo = np.empty(nr, np.int64)  # row r sees keys lo[r] <= j < hi[r]
    hi = np.empty(nr, np.int64)
    m, den = np.empty(nr, np.float32), np.empty(nr, np.float32)  # (np.empty and a loop: np.full / np.zeros
    acc = np.empty((nr, hd), np.float32)                            # cost more compile time than the kernel)
    for r in range(nr):
        m[r], den[r] = -np.inf, 0.0
        for d in range(hd):
            acc[r, d] = 0.0
    s = np.empty(keys, np.float32)
    kbuf = np.empty((keys, hd), np.float32)
    vbuf = np.empty((keys, hd), np.float32)
    jlo, jhi = np.int64(1) << 62, np.int64(0)
    for r in range(nr):
        t = t0 + r // rep
        p = positions[b, t]
        lo[r] = max(0, p - window + 1) if window > 0 else 0
        hi[r] = p + 1
        jlo, jhi = min(jlo, lo[r]), max(jhi, hi[r])
        for d in range(hd):
            qs[r, d] = q[b, t, kh * rep + r % rep, d] * scale
    for j0 in range(jlo, jhi, keys):
        n = min(keys, jhi - j0)
        kt, ko = k_block(k[b, kh], j0, n, kbuf)  # noqa: F821 (bound per K cache format): rows ko .. ko + n
        vt, vo = v_block(v[b, kh], j0, n, vbuf)  # noqa: F821 (bound per V cache format)
        for r in range(nr):
            a, e = max(lo[r] - j0, 0), min(hi[r] - j0, n)  # this row's keys in the block
            if a >= e:
                continue
            if simd:
                mb = block_scores(qs, r, kt, ko + a, e - a, s)
            else:
                mb = np.float32(-np.inf)
                for j in range(e - a):
                    x = np.float32(0.0)
                    for d in range(hd):
                        x += qs[r, d] * kt[ko + a + j, d]
                    s[j] = x
                    mb = max(mb, x)
            if mb > m[r]:  # the max grew: rescale what was accumulated, once per block
                corr = np.float32(math.exp(m[r] - mb)) if m[r] > -np.inf else np.float32(0.0)
                den[r] *= corr
                for d in range(hd):
                    acc[r, d] *= corr
                m[r] = mb
            mr = m[r]
            tot = np.float32(0.0)
            for j in range(e - a):
                w = exp_nonpos(s[j] - mr)
                s[j] = w
                tot += w
            den[r] += tot
            if simd:
                block_pv(acc, r, s, vt, vo + a, e - a)
            else:
                for j in range(e - a):
                    for d in range(hd):
                        acc[r, d] += s[j] * vt[vo + a + j, d]
    for r in range(nr):  # a sink (-inf: none) adds exp(sink - m) to the denominator only
        inv = np.float32(1.0) / (den[r] + np.float32(math.exp(sinks[kh * rep + r % rep] - m[r])))
        for d in range(hd):
            out[b, t0 + r // rep, kh * rep + r % rep, d] = acc[r, d] * inv


# reassociation lets LLVM vectorise the dot-product reductions; no nnan/ninf (the softmax uses -inf)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@functools.cache
def kernel_for(k_name: str, v_name: str) -> Kernel:
    """The attention kernel of one (K format, V format) pair, with only their row codecs compiled in."""
    outer, _ = with_item(_kv_attention, _kv_attention_item, f"__{k_name}_{v_name}", {"fastmath": FASTMATH},
                         k_block=ROW_CODECS[k_name][1], v_block=ROW_CODECS[v_name][1])
    return Kernel(outer, fastmath=FASTMATH)


def kv_attention(q, k_store, v_store, k_fmt, v_fmt, positions, scale: float, window: int = 0,
                 sinks=None) -> np.ndarray:
    out = np.empty(q.shape, np.float32)
    sinks = np.full(q.shape[2], -np.inf, np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    work = q.size * (int(np.max(positions)) + 1) * 2
    kernel_for(k_fmt.name, v_fmt.name)(work, np.ascontiguousarray(q, dtype=np.float32), k_store, v_store,
                                       np.ascontiguousarray(positions, dtype=np.int64), np.float32(scale),
                                       int(window), sinks, out)
    return out
