"""attention (Numba): GQA causal attention over a KV cache; one (sequence, query, head) per iteration.

Online softmax over the visible keys (running max and sum), accumulators in f32.
"""
import math

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def _attention(q, k, v, positions, scale, window, out):
    B, T, H, hd = q.shape
    rep = H // k.shape[1]
    for idx in prange(B * T * H):
        b = idx // (T * H)
        t = (idx // H) % T
        h = idx % H
        kh = h // rep
        p = positions[b, t]
        lo = max(0, p - window + 1) if window > 0 else 0
        m = -np.inf
        denom = np.float32(0.0)
        acc = np.zeros(hd, np.float32)
        for j in range(lo, p + 1):
            s = np.float32(0.0)
            for d in range(hd):
                s += q[b, t, h, d] * k[b, kh, j, d]
            s *= scale
            if s > m:
                corr = np.float32(math.exp(m - s)) if m > -np.inf else np.float32(0.0)
                denom *= corr
                for d in range(hd):
                    acc[d] *= corr
                m = s
            e = np.float32(math.exp(s - m))
            denom += e
            for d in range(hd):
                acc[d] += e * v[b, kh, j, d]
        for d in range(hd):
            out[b, t, h, d] = acc[d] / denom


def attention(q, k, v, positions, scale: float, window: int = 0) -> np.ndarray:
    out = np.empty(q.shape, np.float32)
    _attention(np.ascontiguousarray(q, dtype=np.float32), k, v, np.ascontiguousarray(positions, dtype=np.int64),
               np.float32(scale), int(window), out)
    return out
