"""cuda topk_softmax: launcher of ``cuda_src/topk_softmax.cu``.

``logits f32 [T, E]`` (E <= 256) -> ``(weights f32 [T, A], ids int32 [T, A])``; see toolkit/ref/topk_softmax.py.
"""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "topk_softmax"
KERNELS = ("topk_softmax_kernel",)
WARPS, MAX_E = 4, 256  # TOPK_WARPS, 32 * TOPK_PER_LANE in the .cu


def check_topk_softmax(logits, k: int) -> None:
    check_array("topk_softmax", "logits", logits, np.float32, ndim=2)
    E = logits.shape[1]
    contract("topk_softmax", 1 <= E <= MAX_E, f"E={E} experts; the kernel holds 1..{MAX_E}")
    contract("topk_softmax", 1 <= int(k) <= E, f"k={k} must be in 1..E={E}")


def run_topk_softmax(rt, logits, k: int, renormalize: bool):
    check_topk_softmax(logits, k)
    T, E = logits.shape
    w = rt.xp.empty((T, k), np.float32)  # [T, A]
    ids = rt.xp.empty((T, k), np.int32)  # [T, A]
    if T:
        rt.launch(SOURCE, "topk_softmax_kernel", (-(-T // WARPS),), (32 * WARPS,),
                  (logits, w, ids, np.int32(T), np.int32(E), np.int32(k), np.int32(bool(renormalize))))
    return w, ids

