"""cuda topk_sigmoid: launcher of ``cuda_src/topk_sigmoid.cu``.

``logits f32 [T, E]`` (E <= 256), ``bias f32 [E]`` -> ``(weights f32 [T, A], ids int32 [T, A])``; see
toolkit/ref/topk_sigmoid.py. The model always passes a bias (zeros when the checkpoint has none).
"""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "topk_sigmoid"
KERNELS = ("topk_sigmoid_kernel",)
WARPS, MAX_E, MAX_GROUPS = 4, 256, 32  # ROUTE_WARPS, 32 * ROUTE_PER_LANE, ROUTE_MAX_GROUPS in routing.cuh


def check_grouped(op: str, logits, k: int, n_group: int, topk_group: int) -> None:
    check_array(op, "logits", logits, np.float32, ndim=2)
    E = logits.shape[1]
    contract(op, 1 <= E <= MAX_E, f"E={E} experts; the kernel holds 1..{MAX_E}")
    contract(op, 1 <= n_group <= MAX_GROUPS and E % n_group == 0, f"n_group={n_group} must divide E={E} and be at most {MAX_GROUPS}")
    contract(op, 1 <= topk_group <= n_group, f"topk_group={topk_group} must be in 1..n_group={n_group}")
    eligible = E if topk_group >= n_group else topk_group * (E // n_group)
    contract(op, 1 <= int(k) <= eligible, f"k={k} must be in 1..{eligible} (the experts of the topk_group best groups)")


def run_topk_sigmoid(rt, logits, bias, k: int, n_group: int, topk_group: int, renormalize: bool, scale: float):
    check_grouped("topk_sigmoid", logits, k, n_group, topk_group)
    T, E = logits.shape
    check_array("topk_sigmoid", "bias", bias, np.float32, shape=(E,))
    w = rt.xp.empty((T, k), np.float32)  # [T, A]
    ids = rt.xp.empty((T, k), np.int32)  # [T, A]
    if T:
        rt.launch(SOURCE, "topk_sigmoid_kernel", (-(-T // WARPS),), (32 * WARPS,),
                  (logits, bias, w, ids, np.int32(T), np.int32(E), np.int32(k), np.int32(n_group),
                   np.int32(topk_group), np.int32(bool(renormalize)), np.float32(scale)))
    return w, ids
