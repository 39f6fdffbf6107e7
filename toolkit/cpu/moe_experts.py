"""moe_experts (Numba + BLAS) for dense f32 expert weights: tokens are grouped by expert once (a counting
sort, as moe_align does). A few rows per expert (a batch's decode step) run the grouped GEMV
(``toolkit/cpu/grouped_gemv.py``) over every expert that has rows, once for gate_up and once for down; many rows
(prefill) run two BLAS GEMMs per expert on its contiguous rows. The weighted results are added back. One row
(a single sequence's decode step) runs ``gemv_f32``, as the compiled decode step does. Quantized experts use
the grouped kernels instead."""
import numpy as np
from numba import njit

from ..threads import blas_for, xwt
from .fused_moe import activation
from .gemv_f32 import gemv_f32
from .grouped_gemv import ROWS_MAX, grouped_gemv
from .silu_and_mul import silu_and_mul


@njit(cache=True)
def _group_by_expert(ids, n_experts):  # ids [T, A] -> order [T*A] (flat slot ids sorted by expert), offsets [E+1]
    flat = ids.reshape(-1)
    counts = np.zeros(n_experts + 1, np.int64)
    for i in range(flat.shape[0]):
        counts[flat[i] + 1] += 1
    for e in range(n_experts):
        counts[e + 1] += counts[e]
    fill = counts[:-1].copy()
    order = np.empty(flat.shape[0], np.int64)
    for i in range(flat.shape[0]):
        e = flat[i]
        order[fill[e]] = i
        fill[e] += 1
    return order, counts


@njit(cache=True)
def _scatter_add(out, y, order, lo, k, weights_flat):
    for r in range(y.shape[0]):
        slot = order[lo + r]
        t = slot // k
        w = weights_flat[slot]
        for d in range(y.shape[1]):
            out[t, d] += w * y[r, d]


def _few_rows(x, order, offsets, active, k, weights, gate_up, down):
    """A few rows per expert: the grouped GEMV, twice, and the weighted rows added back (``_scatter_add``)."""
    S, (N1, D) = order.shape[0], gate_up.shape[1:]
    x = np.ascontiguousarray(x, dtype=np.float32)
    g = np.empty((S, N1), np.float32)  # [S, 2I], rows sorted by expert
    grouped_gemv(x, order // k, offsets, active, gate_up, g)
    h = silu_and_mul(g)  # [S, I]
    y = np.empty((S, D), np.float32)  # [S, D]
    grouped_gemv(h, np.arange(S), offsets, active, down, y)
    out = np.zeros((x.shape[0], D), np.float32)  # [T, D]
    _scatter_add(out, y, order, 0, k, np.ascontiguousarray(weights, dtype=np.float32).reshape(-1))
    return out


def _one_token(x, ids, weights, gate_up, down):
    out = np.zeros((1, down.shape[1]), np.float32)  # [1, D]
    g = np.empty((1, gate_up.shape[1]), np.float32)  # [1, 2I]
    y = np.empty(down.shape[1], np.float32)
    xr = np.ascontiguousarray(x[0], np.float32)
    for e, w in zip(ids[0], np.asarray(weights, np.float32)[0]):
        gemv_f32(gate_up[e], xr, g[0])
        gemv_f32(down[e], silu_and_mul(g)[0], y)
        out += w * y
    return out


def moe_experts(x, ids, weights, gate_up, down, bias=None, act=None) -> np.ndarray:
    """``bias``: (gate_up bias [E, 2I], down bias [E, D]) or None; ``act``: see fused_moe.activation."""
    T, k = ids.shape
    f = activation(act)
    if bias is None:
        expert = lambda xe, e: xwt(f(xwt(xe, gate_up[e])), down[e])  # noqa: E731
    else:
        expert = lambda xe, e: xwt(f(xwt(xe, gate_up[e]) + bias[0][e]), down[e]) + bias[1][e]  # noqa: E731
    if T == 1 and bias is None and act is None:  # a decode step: its k experts by the decode GEMV (the one the
        return _one_token(x, ids, weights, gate_up, down)  # compiled decode step calls: the same bits)
    if T == 1:  # a decode step: its k experts directly (no grouping, no scatter)
        blas_for(gate_up.shape[1] * gate_up.shape[2])
        out = np.zeros((1, down.shape[1]), np.float32)  # [1, D]
        for e, w in zip(ids[0], np.asarray(weights, np.float32)[0]):
            out += w * expert(x, e)
        return out
    order, offsets = _group_by_expert(np.ascontiguousarray(ids, dtype=np.int64), gate_up.shape[0])
    active = np.flatnonzero(np.diff(offsets))  # experts with rows
    if bias is None and act is None and T * k <= ROWS_MAX * len(active):
        return _few_rows(x, order, offsets, active, k, weights, gate_up, down)
    out = np.zeros((T, down.shape[1]), np.float32)  # [T, D]
    wflat = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
    for e in range(gate_up.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if hi == lo:
            continue
        xe = x[order[lo:hi] // k]  # [n, D]
        blas_for((hi - lo) * gate_up.shape[1] * gate_up.shape[2])  # one BLAS thread for decode-sized products
        y = expert(xe, e)  # [n, D]
        _scatter_add(out, np.ascontiguousarray(y, dtype=np.float32), order, lo, k, wflat)
    return out
