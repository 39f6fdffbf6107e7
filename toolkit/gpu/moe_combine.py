"""cuda moe_combine: launcher of ``cuda_src/moe_combine.cu``. ``y f32 [T*A, D], top_k -> [T, D]``."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "moe_combine"
KERNELS = ("moe_combine_kernel",)
THREADS = 256


def check_moe_combine(y, top_k: int) -> None:
    check_array("moe_combine", "y", y, np.float32, ndim=2)
    contract("moe_combine", int(top_k) >= 1 and y.shape[0] % int(top_k) == 0,
             f"y.shape[0]={y.shape[0]} slots must be a multiple of top_k={top_k}")


def run_moe_combine(rt, y, top_k: int):
    check_moe_combine(y, top_k)
    T, D = y.shape[0] // top_k, y.shape[1]
    out = rt.xp.empty((T, D), np.float32)  # [T, D]
    if T and D:
        rt.launch(SOURCE, "moe_combine_kernel", (T, -(-D // THREADS)), (THREADS,), (y, out, np.int32(D), np.int32(top_k)))
    return out

