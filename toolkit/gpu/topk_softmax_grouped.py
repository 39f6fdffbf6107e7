"""cuda topk_softmax_grouped: launcher of ``cuda_src/topk_softmax_grouped.cu``.

``logits f32 [T, E]`` (E <= 256) -> ``(weights f32 [T, A], ids int32 [T, A])``; see
toolkit/ref/topk_softmax_grouped.py.
"""
from __future__ import annotations

import numpy as np

from .topk_sigmoid import WARPS, check_grouped

SOURCE = "topk_softmax_grouped"
KERNELS = ("topk_softmax_grouped_kernel",)


def run_topk_softmax_grouped(rt, logits, k: int, n_group: int, topk_group: int, scale: float):
    check_grouped("topk_softmax_grouped", logits, k, n_group, topk_group)
    T, E = logits.shape
    w = rt.xp.empty((T, k), np.float32)  # [T, A]
    ids = rt.xp.empty((T, k), np.int32)  # [T, A]
    if T:
        rt.launch(SOURCE, "topk_softmax_grouped_kernel", (-(-T // WARPS),), (32 * WARPS,),
                  (logits, w, ids, np.int32(T), np.int32(E), np.int32(k), np.int32(n_group), np.int32(topk_group),
                   np.float32(scale)))
    return w, ids
