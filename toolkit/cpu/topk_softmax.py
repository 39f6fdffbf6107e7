"""topk_softmax (Numba): router softmax and top-k per token; ties go to the lower expert id."""
import math

import numpy as np
from numba import njit, prange

from ._jit import kernel


@njit(cache=True)
def softmax_row(logits, t):
    """Row ``t`` of ``logits [T, E]`` -> its softmax ``[E]`` in f32 (max subtracted first)."""
    E = logits.shape[1]
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
    return p


@kernel()
def _topk_softmax(logits, k, renormalize, w_out, id_out):
    T, E = logits.shape
    for t in prange(T):
        p = softmax_row(logits, t)
        taken = np.empty(E, np.bool_)
        for e in range(E):
            taken[e] = False
        chosen = np.float32(0.0)
        for a in range(k):
            best = -1
            for e in range(E):  # strict '>' keeps the lower id on ties
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            id_out[t, a] = best
            w_out[t, a] = p[best]
            chosen += p[best]
        if renormalize:
            for a in range(k):
                w_out[t, a] = w_out[t, a] / chosen


def topk_softmax(logits: np.ndarray, k: int, renormalize: bool):
    x = np.ascontiguousarray(logits, dtype=np.float32)
    w = np.empty((x.shape[0], k), np.float32)
    ids = np.empty((x.shape[0], k), np.int32)
    _topk_softmax(x.size * 4, x, int(k), bool(renormalize), w, ids)
    return w, ids
