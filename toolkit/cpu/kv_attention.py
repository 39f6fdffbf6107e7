"""kv_attention (Numba): GQA causal attention reading the cache in its stored format.

One (sequence, query, head) per parallel iteration; for each visible key the dot product q.k and the
update acc += p * v decode the row's blocks inside the loop (online softmax, f32 accumulators); the
cache is never dequantized to a temporary. One kernel per (K format, V format) pair, built from the
row codecs of :mod:`toolkit.cpu.kv_codecs`.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit, prange

from .kv_codecs import ROW_CODECS


@functools.cache
def _kernel(k_name: str, v_name: str):
    k_dot = ROW_CODECS[k_name][1]
    v_axpy = ROW_CODECS[v_name][2]

    @njit(cache=False, parallel=True, fastmath=False)
    def kernel(q, k, v, positions, scale, window, out):
        B, T, H, hd = q.shape
        rep = H // k.shape[1]
        for idx in prange(B * T * H):
            b = idx // (T * H)
            t = (idx // H) % T
            h = idx % H
            kh = h // rep
            p = positions[b, t]
            lo = max(0, p - window + 1) if window > 0 else 0
            qv = q[b, t, h]
            m = -np.inf
            denom = np.float32(0.0)
            acc = np.zeros(hd, np.float32)
            for j in range(lo, p + 1):
                s = k_dot(k[b, kh, j], qv) * scale
                if s > m:
                    corr = np.float32(math.exp(m - s)) if m > -np.inf else np.float32(0.0)
                    denom *= corr
                    for d in range(hd):
                        acc[d] *= corr
                    m = s
                e = np.float32(math.exp(s - m))
                denom += e
                v_axpy(v[b, kh, j], e, acc)
            for d in range(hd):
                out[b, t, h, d] = acc[d] / denom

    return kernel


def kv_attention(q, k_store, v_store, k_fmt, v_fmt, positions, scale: float, window: int = 0) -> np.ndarray:
    out = np.empty(q.shape, np.float32)
    _kernel(k_fmt.name, v_fmt.name)(np.ascontiguousarray(q, dtype=np.float32), k_store, v_store,
                                    np.ascontiguousarray(positions, dtype=np.int64), np.float32(scale), int(window), out)
    return out
