"""rms_norm (Numba): ``[T, D] -> [T, D]``; rows in parallel, sum of squares in f32 like the reference."""
import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def _rms_norm(x, w, eps, out):
    for t in prange(x.shape[0]):
        ss = np.float32(0.0)
        for d in range(x.shape[1]):
            ss += x[t, d] * x[t, d]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[1]) + eps)
        for d in range(x.shape[1]):
            out[t, d] = (x[t, d] * inv) * w[d]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _rms_norm(x2.size, x2, np.ascontiguousarray(w, dtype=np.float32), np.float32(eps), out)
    return out.reshape(x.shape)
