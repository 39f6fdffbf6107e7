"""clamped_swiglu (Numba): gpt-oss's expert activation, ``[T, 2I] -> [T, I]`` (toolkit/ref/clamped_swiglu.py)."""
import math

import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def _clamped_swiglu(x, alpha, limit, out):
    n = out.shape[1]
    for t in prange(x.shape[0]):
        for i in range(n):
            g = min(x[t, i], limit)
            u = min(max(x[t, n + i], -limit), limit)
            out[t, i] = (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.float32(math.exp(-alpha * g))))


def clamped_swiglu(x: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty((x2.shape[0], x2.shape[1] // 2), np.float32)
    _clamped_swiglu(x2.size, x2, np.float32(alpha), np.float32(limit), out)
    return out.reshape(*x.shape[:-1], -1)
