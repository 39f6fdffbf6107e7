"""gemv_f32 (Numba): ``out [N] = w [N, K] . x [K]`` for a dense f32 weight and one input row.

The CPU runtime's product at one token (``Runtime.linear``, the dense experts of ``moe_experts``) and every
dense product of the compiled decode step (``toolkit/cpu/decode_layer.py``) call this one function, so the
two decode paths give the same bits. As fast as OpenBLAS's sgemv on one thread at these sizes (bundled model,
same run: 384 x 256 5.2 vs 6.0 us, 8192 x 256 323 vs 340 us); BLAS keeps the larger products and prefill.
"""
import numpy as np
from numba import njit


@njit(cache=True, fastmath=True)
def gemv_f32(w, x, out):
    """Rows of w 4 at a time, sharing each load of x; the loop over K vectorised by LLVM."""
    N, K = w.shape
    for n in range(0, N - 3, 4):
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
