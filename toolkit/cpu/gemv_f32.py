"""gemv_f32 (Numba): ``out [N] = w [N, K] . x [K]`` for a dense f32 weight and one input row (and
``gemv_f16`` / ``gemv_bf16`` for 16-bit ones).

The CPU runtime's product at one token (``Runtime.linear``, the dense experts of ``moe_experts``) and every
dense product of the compiled decode step (``toolkit/cpu/decode_layer.py``) call this one function, so the
two decode paths give the same bits. As fast as OpenBLAS's sgemv on one thread at these sizes (bundled model,
same run: 384 x 256 5.2 vs 6.0 us, 8192 x 256 323 vs 340 us); BLAS keeps the larger products and prefill.
"""
import numpy as np
from numba import njit, prange

from ._jit import twin
from .vec import f32_bits, half


def _gemv_f32(w, x, out):
    """Rows of w 4 at a time, sharing each load of x; the loop over K vectorised by LLVM. Written once with
    ``prange`` over the blocks of 4 rows: the serial build runs it as a plain loop, the parallel build splits the
    blocks over the threads; each row's sum is computed the same way in both (the same bits)."""
    N, K = w.shape
    for b in prange(N // 4):
        n = 4 * b
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            xk = x[k]
            a0 += w[n, k] * xk
            a1 += w[n + 1, k] * xk
            a2 += w[n + 2, k] * xk
            a3 += w[n + 3, k] * xk
        out[n], out[n + 1], out[n + 2], out[n + 3] = a0, a1, a2, a3
    for n in range(N // 4 * 4, N):
        a = np.float32(0.0)
        for k in range(K):
            a += w[n, k] * x[k]
        out[n] = a


gemv_f32 = njit(cache=True, fastmath=True)(_gemv_f32)
gemv_f32_parallel = njit(cache=True, fastmath=True, parallel=True)(twin(_gemv_f32, "__parallel"))


def _gemv_16(w, x, out):
    """Template (WIDEN bound: f16 or bf16 bits -> f32, exact): ``out [N] = w [N, K] . x [K]`` for uint16 bits
    ``w``, the loop of ``gemv_f32`` (so a 16-bit weight gives the bits of its f32 copy)."""
    N, K = w.shape
    for n in range(0, N - 3, 4):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            xk = x[k]
            a0 += WIDEN(w[n, k]) * xk  # noqa: F821
            a1 += WIDEN(w[n + 1, k]) * xk  # noqa: F821
            a2 += WIDEN(w[n + 2, k]) * xk  # noqa: F821
            a3 += WIDEN(w[n + 3, k]) * xk  # noqa: F821
        out[n], out[n + 1], out[n + 2], out[n + 3] = a0, a1, a2, a3
    for n in range(N // 4 * 4, N):
        a = np.float32(0.0)
        for k in range(K):
            a += WIDEN(w[n, k]) * x[k]  # noqa: F821
        out[n] = a


@njit(cache=True, inline="always")
def _bf16(b):
    return f32_bits(np.uint32(b) << np.uint32(16))


# 16-bit dense weights at one token, below the parallel threshold (the LM head of a small model): a plain loop
# that compiles in well under a second, where the format's template GEMV (toolkit/cpu/gemv.py) takes seconds.
gemv_f16 = njit(cache=True, fastmath=True)(twin(_gemv_16, "__f16", WIDEN=half))
gemv_bf16 = njit(cache=True, fastmath=True)(twin(_gemv_16, "__bf16", WIDEN=_bf16))
