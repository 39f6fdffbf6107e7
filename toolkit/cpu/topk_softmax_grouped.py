"""topk_softmax_grouped (Numba): the DeepSeek-V2 router (toolkit/ref/topk_softmax_grouped.py)."""
import numpy as np
from numba import prange

from ._jit import kernel
from .topk_sigmoid import pick_grouped
from .topk_softmax import softmax_row


@kernel()
def _topk_softmax_grouped(logits, k, n_group, topk_group, scale, w_out, id_out):
    T, E = logits.shape
    for t in prange(T):
        p = softmax_row(logits, t)
        pick_grouped(p, p, k, n_group, topk_group, False, w_out, id_out, t)
        for a in range(k):
            w_out[t, a] = w_out[t, a] * scale


def topk_softmax_grouped(logits: np.ndarray, k: int, n_group: int, topk_group: int, scale: float):
    x = np.ascontiguousarray(logits, dtype=np.float32)
    w = np.empty((x.shape[0], k), np.float32)
    ids = np.empty((x.shape[0], k), np.int32)
    _topk_softmax_grouped(x.size * 8, x, int(k), int(n_group), int(topk_group), np.float32(scale), w, ids)
    return w, ids
