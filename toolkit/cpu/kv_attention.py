"""kv_attention (Numba): GQA causal attention reading the cache in its stored format.

One (sequence, query token, KV head) per parallel iteration, serving the ``H / Hkv`` query heads that share
the KV head, so each cached block is decoded once per step, not once per query head. For each visible key
the dot products q.k and the update acc += p * v decode the row block by block inside the loop (online
softmax, f32 accumulators); the cache is never dequantized to a temporary. The row codecs of
:mod:`toolkit.cpu.kv_codecs` are selected by the K and V row codes.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import prange

from ._jit import Kernel, twin
from .kv_codecs import F16_LUT, ROW_CODECS


def _kv_attention(q, k, v, positions, scale, window, lut, out):
    B, T, H, hd = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    for idx in prange(B * T * Hkv):  # one (sequence, query token, KV head): its rep query heads together
        b = idx // (T * Hkv)
        t = (idx // Hkv) % T
        kh = idx % Hkv
        p = positions[b, t]
        lo = max(0, p - window + 1) if window > 0 else 0
        qv = q[b, t, kh * rep : (kh + 1) * rep]  # [rep, hd]
        m = np.full(rep, -np.inf, np.float32)
        denom = np.zeros(rep, np.float32)
        acc = np.zeros((rep, hd), np.float32)
        s = np.empty(rep, np.float32)
        e = np.empty(rep, np.float32)
        wbuf = np.empty(hd, np.float32)  # one decoded row
        for j in range(lo, p + 1):
            row_dot(k[b, kh, j], qv, s, wbuf, lut)  # noqa: F821 (bound per K cache format)
            for r in range(rep):
                sr = s[r] * scale
                if sr > m[r]:  # online softmax: rescale what was accumulated under the old max
                    corr = np.float32(math.exp(m[r] - sr)) if m[r] > -np.inf else np.float32(0.0)
                    denom[r] *= corr
                    for d in range(hd):
                        acc[r, d] *= corr
                    m[r] = sr
                e[r] = np.float32(math.exp(sr - m[r]))
                denom[r] += e[r]
            row_axpy(v[b, kh, j], e, acc, wbuf, lut)  # noqa: F821 (bound per V cache format)
        for r in range(rep):
            for d in range(hd):
                out[b, t, kh * rep + r, d] = acc[r, d] / denom[r]


# reassociation lets LLVM vectorise the dot-product reductions; no nnan/ninf (the softmax uses -inf)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@functools.cache
def kernel_for(k_name: str, v_name: str) -> Kernel:
    """The attention kernel of one (K format, V format) pair, with only their row codecs compiled in."""
    return Kernel(twin(_kv_attention, f"__{k_name}_{v_name}", row_dot=ROW_CODECS[k_name][1],
                       row_axpy=ROW_CODECS[v_name][2]), fastmath=FASTMATH)


def kv_attention(q, k_store, v_store, k_fmt, v_fmt, positions, scale: float, window: int = 0) -> np.ndarray:
    out = np.empty(q.shape, np.float32)
    work = q.size * (int(np.max(positions)) + 1) * 2
    kernel_for(k_fmt.name, v_fmt.name)(work, np.ascontiguousarray(q, dtype=np.float32), k_store, v_store,
                                       np.ascontiguousarray(positions, dtype=np.int64), np.float32(scale),
                                       int(window), F16_LUT, out)
    return out
