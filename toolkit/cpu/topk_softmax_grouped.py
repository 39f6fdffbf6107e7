"""topk_softmax_grouped (Numba): the DeepSeek-V2 router (toolkit/ref/topk_softmax_grouped.py)."""
import math

import numpy as np
from numba import prange

from ._jit import kernel
from .topk_sigmoid import pick_grouped


@kernel()
def _topk_softmax_grouped(logits, k, n_group, topk_group, scale, w_out, id_out):
    T, E = logits.shape
    for t in prange(T):
        mx = logits[t, 0]
        for e in range(1, E):
            mx = max(mx, logits[t, e])
        p = np.empty(E, np.float32)
        total = np.float32(0.0)
        for e in range(E):
            p[e] = np.float32(math.exp(logits[t, e] - mx))
            total += p[e]
        for e in range(E):
            p[e] = p[e] / total
        pick_grouped(p, p, k, n_group, topk_group, False, w_out, id_out, t)
        for a in range(k):
            w_out[t, a] = w_out[t, a] * scale


def topk_softmax_grouped(logits: np.ndarray, k: int, n_group: int, topk_group: int, scale: float):
    x = np.ascontiguousarray(logits, dtype=np.float32)
    w = np.empty((x.shape[0], k), np.float32)
    ids = np.empty((x.shape[0], k), np.int32)
    _topk_softmax_grouped(x.size * 8, x, int(k), int(n_group), int(topk_group), np.float32(scale), w, ids)
    return w, ids
