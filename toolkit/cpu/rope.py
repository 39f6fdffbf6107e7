"""rope (Numba): rotate-half rotary embedding; ``x [B, T, n, hd]``, ``positions [B, T]`` -> new array."""
import math

import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def _rope(x, positions, inv_freq, scale, out):
    B, T, n, hd = x.shape
    half = inv_freq.shape[0]  # rd/2: the dims past rd (partial rotary) are copied
    for bt in prange(B * T):
        b, t = bt // T, bt % T
        p = np.float32(positions[b, t])
        for i in range(half):
            ang = p * inv_freq[i]  # f32 product, as the reference
            c = np.float32(math.cos(ang)) * scale
            s = np.float32(math.sin(ang)) * scale
            for h in range(n):
                x1 = x[b, t, h, i]
                x2 = x[b, t, h, i + half]
                out[b, t, h, i] = x1 * c - x2 * s
                out[b, t, h, i + half] = x2 * c + x1 * s
        for h in range(n):
            for i in range(2 * half, hd):
                out[b, t, h, i] = x[b, t, h, i]


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _rope(x.size, x, np.ascontiguousarray(positions, dtype=np.int64), np.ascontiguousarray(inv_freq, dtype=np.float32),
          np.float32(scale), out)
    return out
