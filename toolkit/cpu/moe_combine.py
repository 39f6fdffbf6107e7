"""moe_combine (Numba): ``y [T*A, D] -> [T, D]``, sum over each token's A slots; prange over tokens when the
work pays for the threads (the serial/parallel picker of ``toolkit/cpu/_jit.py``)."""
import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def _combine(y, top_k, out):  # y [T*A, D] -> out [T, D]
    for t in prange(out.shape[0]):
        for d in range(out.shape[1]):
            out[t, d] = y[t * top_k, d]
        for a in range(1, top_k):
            for d in range(out.shape[1]):
                out[t, d] += y[t * top_k + a, d]


def moe_combine(y, top_k: int) -> np.ndarray:
    y = np.ascontiguousarray(y, dtype=np.float32)
    out = np.empty((y.shape[0] // top_k, y.shape[1]), np.float32)  # [T, D]
    _combine(y.size, y, top_k, out)
    return out
