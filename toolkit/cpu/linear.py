"""linear on the CPU: one token goes to the f32 GEMV the compiled decode step calls too (split over the threads
when large; never BLAS, whose workers spin after a call on the cores the next layers need); a few rows (a
batch's decode step) to the grouped GEMV (``toolkit/cpu/grouped_gemv.py``: BLAS would pack the weight for
each); more rows to BLAS with the weight packed as the right operand (``toolkit.threads.xwt``), one BLAS
thread for small products."""
import numpy as np

from ..threads import BLAS_MIN_WORK, blas_for, threads, xwt
from .gemv_f32 import gemv_f32, gemv_f32_parallel
from .grouped_gemv import ROWS_MAX, rows_gemv


def linear(x, w, b=None):
    """``x [T, K] @ w [N, K].T (+ b)`` for a dense f32 weight -> ``[T, N]`` f32."""
    work = x.shape[0] * w.shape[0] * w.shape[1]
    if x.shape[0] == 1:
        gemv = gemv_f32_parallel if work >= BLAS_MIN_WORK and threads() > 1 else gemv_f32
        y = np.empty((1, w.shape[0]), np.float32)  # [1, N]
        gemv(w, np.ascontiguousarray(x[0], np.float32), y[0])
        return y + b if b is not None else y
    if x.shape[0] <= ROWS_MAX and w.flags.c_contiguous:
        y = rows_gemv(x, w)  # [T, N]
    else:
        blas_for(work)
        y = xwt(x, w)  # [T, N]
    return y + b if b is not None else y
