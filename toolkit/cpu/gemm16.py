"""gemm16 (Numba): ``out [M, N] = x [M, K] f32 @ w [N, K].T`` for a 16-bit weight (f16 or bf16 bits) read as
stored: every weight vector is widened in registers (``vcvtph2ps``, or a shift for bf16), never into a copy.

The product of prefill's 16-bit weights (attention's projections, the LM head over every prompt row, 16-bit
experts): before, each tile of weight rows was widened into an f32 scratch and multiplied by BLAS, so every
weight byte was written and read again as twice as many (Mixtral's q|k|v and o at 64 rows, one thread: 12 of
the 65 ms went to widening). Spec: the plain product ``x @ w.astype(f32).T`` (``toolkit/ref/qlinear.py``).

Tile: 6 weight rows x 4 input rows, 24 vector accumulators along K (each weight vector used by 4 rows, each
input vector by 6: 10 loads per 24 FMAs, 31 of AVX-512's 32 registers; on AVX2 the same code at 8 lanes keeps
some accumulators in L1, measured at the AVX2 FMA rate). The 6 weight rows stay in L1/L2 while every input row
of a block of ``MC`` passes (``mc``: the block of input rows that fits ``X_BLOCK_BYTES`` of L2); threads
split the weight rows (``prange`` over blocks of 6), so every output is one dot product in one order: the same
bits at any thread count and any block size. K is a multiple of the lane count (every model's hidden size;
``applies`` says when, other K take the tiled path of ``moe_gemm``).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ._jit import Kernel, twin
from .gemv import _nop  # WIDE() of 8-lane builds
from .vec import fma, hsum, max_lanes, ops, wide

ROWS, COLS = 6, 4  # weight rows x input rows per register tile
X_BLOCK_BYTES = 1 << 20  # input rows per block: at most this many bytes of x (half of this machine's 2 MB L2)


def _put(o, n, N, y0, y1, y2, y3, y4, y5):
    """o[n : n + 6] = the tile's 6 sums, clipped at N."""
    ys = (y0, y1, y2, y3, y4, y5)
    for r in range(min(ROWS, N - n)):
        o[n + r] = ys[r]


def _gemm16(w, x, mc, out):
    """Template (L, LOADW, LOAD, ZERO, WIDE, PUT bound): see the module docstring. w [N, K] uint16, x [M, K],
    out [M, N]."""
    N, K = w.shape
    M = x.shape[0]
    last = N - 1
    for m0 in range(0, M, mc):
        m1 = min(M, m0 + mc)
        for b in prange((N + ROWS - 1) // ROWS):
            WIDE()  # noqa: F821
            n = ROWS * b
            w0, w1, w2 = w[n], w[min(n + 1, last)], w[min(n + 2, last)]
            w3, w4, w5 = w[min(n + 3, last)], w[min(n + 4, last)], w[min(n + 5, last)]
            for m in range(m0, m1, COLS):
                x0, x1, x2, x3 = x[m], x[min(m + 1, m1 - 1)], x[min(m + 2, m1 - 1)], x[min(m + 3, m1 - 1)]
                a00, a01, a02, a03, a04, a05 = ZERO(), ZERO(), ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
                a10, a11, a12, a13, a14, a15 = ZERO(), ZERO(), ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
                a20, a21, a22, a23, a24, a25 = ZERO(), ZERO(), ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
                a30, a31, a32, a33, a34, a35 = ZERO(), ZERO(), ZERO(), ZERO(), ZERO(), ZERO()  # noqa: F821
                for k in range(0, K, L):  # noqa: F821
                    v0, v1, v2 = LOADW(w0, k), LOADW(w1, k), LOADW(w2, k)  # noqa: F821
                    v3, v4, v5 = LOADW(w3, k), LOADW(w4, k), LOADW(w5, k)  # noqa: F821
                    u = LOAD(x0, k)  # noqa: F821
                    a00, a01, a02 = fma(v0, u, a00), fma(v1, u, a01), fma(v2, u, a02)
                    a03, a04, a05 = fma(v3, u, a03), fma(v4, u, a04), fma(v5, u, a05)
                    u = LOAD(x1, k)  # noqa: F821
                    a10, a11, a12 = fma(v0, u, a10), fma(v1, u, a11), fma(v2, u, a12)
                    a13, a14, a15 = fma(v3, u, a13), fma(v4, u, a14), fma(v5, u, a15)
                    u = LOAD(x2, k)  # noqa: F821
                    a20, a21, a22 = fma(v0, u, a20), fma(v1, u, a21), fma(v2, u, a22)
                    a23, a24, a25 = fma(v3, u, a23), fma(v4, u, a24), fma(v5, u, a25)
                    u = LOAD(x3, k)  # noqa: F821
                    a30, a31, a32 = fma(v0, u, a30), fma(v1, u, a31), fma(v2, u, a32)
                    a33, a34, a35 = fma(v3, u, a33), fma(v4, u, a34), fma(v5, u, a35)
                PUT(out[m], n, N, hsum(a00), hsum(a01), hsum(a02), hsum(a03), hsum(a04), hsum(a05))  # noqa: F821
                if m + 1 < m1:
                    PUT(out[m + 1], n, N, hsum(a10), hsum(a11), hsum(a12), hsum(a13), hsum(a14), hsum(a15))  # noqa: F821
                if m + 2 < m1:
                    PUT(out[m + 2], n, N, hsum(a20), hsum(a21), hsum(a22), hsum(a23), hsum(a24), hsum(a25))  # noqa: F821
                if m + 3 < m1:
                    PUT(out[m + 3], n, N, hsum(a30), hsum(a31), hsum(a32), hsum(a33), hsum(a34), hsum(a35))  # noqa: F821


@functools.cache
def kernel(kind: str, L: int) -> Kernel:
    """The serial / parallel builds for ``kind`` ('f16' or 'bf16') bits at ``L`` lanes."""
    from numba import njit

    o = ops(L)
    load_w = {"f16": o["load_half"], "bf16": o["load_bf16"]}[kind]
    put = njit(cache=True, inline="always")(twin(_put, "", ROWS=ROWS))
    return Kernel(twin(_gemm16, f"__{kind}_L{L}", L=L, LOADW=load_w, LOAD=o["load"], ZERO=o["zero"],
                       WIDE=wide if L == 16 else _nop, PUT=put, ROWS=ROWS, COLS=COLS),
                  fastmath=True)


KINDS = ("f16", "bf16")


def applies(K: int, lanes: int | None = None) -> bool:
    """Whether a product over ``K`` runs here (K a multiple of the lane count)."""
    return K % (lanes or max_lanes()) == 0


def gemm16(x: np.ndarray, w: np.ndarray, kind: str, lanes: int | None = None) -> np.ndarray:
    """``x [M, K] f32 @ w [N, K].T`` -> ``[M, N]`` f32, ``w`` the uint16 bits of ``kind`` ('f16' / 'bf16')."""
    L = lanes or max_lanes()
    M, K = x.shape
    N = w.shape[0]
    if w.ndim != 2 or w.shape[1] != K or w.dtype != np.uint16 or K % L:
        raise ValueError(f"gemm16: need w uint16 [N, {K}] with K a multiple of {L}, got {w.dtype} {w.shape}")
    x = np.ascontiguousarray(x, np.float32)
    w = np.ascontiguousarray(w)
    mc = max(COLS, X_BLOCK_BYTES // (4 * K) // COLS * COLS)
    out = np.empty((M, N), np.float32)  # [M, N]
    kernel(kind, L)(M * N * K, w, x, mc, out)
    return out


def assembly(kind: str = "f16", L: int | None = None) -> str:
    """The serial kernel's assembly for ``kind`` at ``L`` lanes (default: the host's widest), from an uncached
    build (Numba cannot inspect code loaded from its disk cache). For the assembly test."""
    from numba import njit

    L = L or max_lanes()
    k = kernel(kind, L)
    fn = njit(cache=False, fastmath=True)(twin(k.serial.py_func, "__asm"))
    args = (np.zeros((6, 4 * L), np.uint16), np.zeros((4, 4 * L), np.float32), 4, np.zeros((4, 6), np.float32))
    fn(*args)
    return fn.inspect_asm(fn.signatures[0])
