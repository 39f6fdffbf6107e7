"""grouped_gemv (Numba): dense f32 products of a few rows, grouped by weight matrix.

``grouped_gemv(x, src, offsets, active, w, out)``: ``out[r] = w[e] . x[src[r]]`` for the rows
``r in offsets[e]:offsets[e+1]`` of each matrix ``e in active``; ``w [E, N, K]``, ``x [*, K]``, ``out [S, N]``.
The f32 experts of a batch's decode step (``moe_experts``: a few rows per expert) and any dense product of a
few rows (``linear``, ``rows_gemv``) run here; one row goes to ``gemv_f32``, many rows to BLAS.

Why not BLAS: OpenBLAS packs the weight for every product, which a product of a few rows never pays back. A
decode step of 16 sequences on the bundled model (all 8 experts of every layer hit, about 4 rows each) read its
experts at about 7 GB/s through BLAS. Here the output rows are split over the threads 4 at a time; each block of
4 weight rows is read from memory once and used for an expert's rows two at a time (each weight load feeds two
rows' sums), and the next block is prefetched (the hardware prefetcher does not follow 8 experts' short rows).
A row's sums are those of ``gemv_f32`` (4 weight rows, the loop over K vectorised by LLVM) up to the order of
the additions: equal within f32 rounding, not bit for bit.
"""
import numpy as np
from numba import njit, prange

from ._jit import kernel
from .vec import prefetch

ROWS_MAX = 16  # rows per matrix (mean over the matrices with rows) up to which this beats BLAS here


@njit(cache=True, fastmath=True, inline="always")
def _dot4(w, n, x):  # w [N, K], x [K] -> w[n..n+3] . x
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for j in range(x.shape[0]):
        xj = x[j]
        a0 += w[n, j] * xj
        a1 += w[n + 1, j] * xj
        a2 += w[n + 2, j] * xj
        a3 += w[n + 3, j] * xj
    return a0, a1, a2, a3


@njit(cache=True, fastmath=True, inline="always")
def _dot4x2(w, n, x, y, ox, oy):  # ox[n..n+3] = w[n..n+3] . x, oy[n..n+3] = w[n..n+3] . y
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for j in range(x.shape[0]):
        xj, yj = x[j], y[j]
        w0, w1, w2, w3 = w[n, j], w[n + 1, j], w[n + 2, j], w[n + 3, j]
        a0 += w0 * xj
        a1 += w1 * xj
        a2 += w2 * xj
        a3 += w3 * xj
        b0 += w0 * yj
        b1 += w1 * yj
        b2 += w2 * yj
        b3 += w3 * yj
    ox[n] = a0  # one store each: a tuple unpacked into array elements here lost rows in the parallel build
    ox[n + 1] = a1
    ox[n + 2] = a2
    ox[n + 3] = a3
    oy[n] = b0
    oy[n + 1] = b1
    oy[n + 2] = b2
    oy[n + 3] = b3


@kernel(fastmath=True)
def _grouped_gemv(x, src, offsets, active, w, out):
    N, K = w.shape[1], w.shape[2]
    for b in prange((N + 3) // 4):
        n = 4 * b
        for e in active:
            we = w[e]
            lo, hi = offsets[e], offsets[e + 1]
            if n + 8 <= N:  # this thread's next item reads the next 4 rows of every matrix: fetched now
                for q in range(n + 4, n + 8):
                    for j in range(0, K, 16):
                        prefetch(we[q], j)
            if n + 4 <= N:
                for p in range((hi - lo) // 2):
                    r = lo + 2 * p
                    _dot4x2(we, n, x[src[r]], x[src[r + 1]], out[r], out[r + 1])
                if (hi - lo) % 2 == 1:
                    o = out[hi - 1]
                    o[n], o[n + 1], o[n + 2], o[n + 3] = _dot4(we, n, x[src[hi - 1]])
            else:
                for r in range(lo, hi):
                    xr, o = x[src[r]], out[r]
                    for i in range(n, N):
                        a = np.float32(0.0)
                        for j in range(K):
                            a += we[i, j] * xr[j]
                        o[i] = a


def grouped_gemv(x, src, offsets, active, w, out) -> None:
    """See the module docstring; ``out`` is written in place."""
    _grouped_gemv(out.shape[0] * w.shape[1] * w.shape[2], x, src, offsets, active, w, out)


def rows_gemv(x, w) -> np.ndarray:
    """``x [T, K] @ w [N, K].T`` -> ``[T, N]`` f32 for a few rows (T up to about ROWS_MAX)."""
    T = x.shape[0]
    out = np.empty((T, w.shape[0]), np.float32)  # [T, N]
    grouped_gemv(np.ascontiguousarray(x, dtype=np.float32), np.arange(T), np.array([0, T]), np.zeros(1, np.int64),
                 w.reshape(1, *w.shape), out)
    return out
