"""attention: grouped-query causal attention of new queries over a KV cache.

``q [B, T, H, hd]``, ``k, v [B, Hkv, S, hd]`` (the cache, S >= every visible position),
``positions [B, T]`` (absolute position of each query) -> ``[B, T, H, hd]``.
Query head ``h`` reads KV head ``h // (H / Hkv)``. Key ``j`` is visible to a query at position ``p`` when
``j <= p`` and, with a sliding window ``W > 0``, ``p - j < W``. Softmax in f32 with ``scale`` (1/sqrt(hd)).
``sinks [H]`` (gpt-oss), when given: one more logit per head in the softmax's denominator, attached to no value:
``w_j = exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))``.
"""
import numpy as np


def attention(q, k, v, positions, scale: float, window: int = 0, sinks=None) -> np.ndarray:
    B, T, H, hd = q.shape
    rep = H // k.shape[1]
    out = np.zeros_like(q, dtype=np.float32)
    for b in range(B):
        for t in range(T):
            p = int(positions[b, t])
            lo = max(0, p - window + 1) if window > 0 else 0
            for h in range(H):
                keys = k[b, h // rep, lo : p + 1]  # [n, hd]
                scores = keys @ q[b, t, h] * np.float32(scale)  # [n]
                m = scores.max() if sinks is None else max(scores.max(), np.float32(sinks[h]))
                w = np.exp(scores - m)
                den = w.sum() + (np.exp(np.float32(sinks[h]) - m) if sinks is not None else 0)
                out[b, t, h] = (w / den) @ v[b, h // rep, lo : p + 1]
    return out
