"""moe_bias_add (Numba): per-expert biases on slot-ordered GEMM rows (toolkit/ref/moe_bias_add.py); slots with
id -1 (an expert_map's experts not in this call) are skipped."""
import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def _moe_bias_add(y, bias, ids, weights, weighted):
    A = ids.shape[1]
    for s in prange(y.shape[0]):
        e = ids[s // A, s % A]
        if e >= 0:  # -1: not in this call (never a wrapped index)
            w = weights[s // A, s % A] if weighted else np.float32(1.0)
            for n in range(y.shape[1]):
                y[s, n] += w * bias[e, n]


def moe_bias_add(y: np.ndarray, bias: np.ndarray, ids: np.ndarray, weights=None) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    w = np.ones((1, 1), np.float32) if weights is None else np.ascontiguousarray(weights, dtype=np.float32)
    _moe_bias_add(y.size, y, np.ascontiguousarray(bias, dtype=np.float32), ids, w, weights is not None)
    return y
