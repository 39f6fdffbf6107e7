"""topk_sigmoid (Numba): the DeepSeek-V3 router (toolkit/ref/topk_sigmoid.py); ties go to the lower id."""
import math

import numpy as np
from numba import njit, prange

from ._jit import kernel


@njit(cache=True)
def pick_grouped(c, w_src, k, n_group, topk_group, top2, w_out, id_out, t):
    """Row ``t``: the ``k`` largest ``c [E]`` among the ``topk_group`` best of ``n_group`` groups (group score:
    the sum of its two largest with ``top2``, else its largest) -> ids, and their weights from ``w_src [E]``."""
    E = c.shape[0]
    n = E // n_group
    eligible = np.ones(E, np.bool_)
    if 1 < n_group and topk_group < n_group:
        score = np.empty(n_group, np.float32)
        for g in range(n_group):
            a = np.float32(-np.inf)
            b = np.float32(-np.inf)
            for e in range(g * n, g * n + n):
                if c[e] > a:
                    a, b = c[e], a
                elif c[e] > b:
                    b = c[e]
            score[g] = a + b if top2 and n > 1 else a
        kept = np.zeros(n_group, np.bool_)
        for _ in range(topk_group):
            best = -1
            for g in range(n_group):  # strict '>' keeps the lower group on ties
                if not kept[g] and (best < 0 or score[g] > score[best]):
                    best = g
            kept[best] = True
        for e in range(E):
            eligible[e] = kept[e // n]
    for a in range(k):
        best = -1
        for e in range(E):
            if eligible[e] and (best < 0 or c[e] > c[best]):
                best = e
        eligible[best] = False
        id_out[t, a] = best
        w_out[t, a] = w_src[best]


@kernel()
def _topk_sigmoid(logits, bias, k, n_group, topk_group, renormalize, scale, w_out, id_out):
    T, E = logits.shape
    for t in prange(T):
        s = np.empty(E, np.float32)
        c = np.empty(E, np.float32)
        for e in range(E):
            s[e] = np.float32(1.0 / (1.0 + math.exp(-logits[t, e])))
            c[e] = s[e] + bias[e]
        pick_grouped(c, s, k, n_group, topk_group, True, w_out, id_out, t)
        if renormalize:
            total = np.float32(0.0)
            for a in range(k):
                total += w_out[t, a]
            total += np.float32(1e-20)
            for a in range(k):
                w_out[t, a] = w_out[t, a] / total
        for a in range(k):
            w_out[t, a] = w_out[t, a] * scale


def topk_sigmoid(logits: np.ndarray, bias, k: int, n_group: int, topk_group: int, renormalize: bool, scale: float):
    x = np.ascontiguousarray(logits, dtype=np.float32)
    b = np.zeros(x.shape[1], np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    w = np.empty((x.shape[0], k), np.float32)
    ids = np.empty((x.shape[0], k), np.int32)
    _topk_sigmoid(x.size * 8, x, b, int(k), int(n_group), int(topk_group), bool(renormalize), np.float32(scale), w, ids)
    return w, ids
