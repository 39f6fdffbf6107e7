"""silu_and_mul (Numba): ``[T, 2I] -> [T, I]``."""
import math

import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def _silu_and_mul(x, out):
    n = out.shape[1]
    for t in prange(x.shape[0]):
        for i in range(n):
            g = x[t, i]
            out[t, i] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * x[t, n + i]


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty((x2.shape[0], x2.shape[1] // 2), np.float32)
    _silu_and_mul(x2.size, x2, out)
    return out.reshape(*x.shape[:-1], -1)
