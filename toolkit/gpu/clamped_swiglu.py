"""cuda clamped_swiglu: launcher of ``cuda_src/clamped_swiglu.cu``. ``x f32 [T, 2I] -> [T, I]``."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "clamped_swiglu"
KERNELS = ("clamped_swiglu_kernel",)
THREADS, PER_THREAD = 256, 4


def run_clamped_swiglu(rt, x, alpha: float, limit: float):
    check_array("clamped_swiglu", "x", x, np.float32, ndim=2)
    contract("clamped_swiglu", x.shape[1] % 2 == 0, f"x.shape[1]={x.shape[1]} must be even (gate then up)")
    T, I = x.shape[0], x.shape[1] // 2
    out = rt.xp.empty((T, I), np.float32)  # [T, I]
    if T and I:
        rt.launch(SOURCE, "clamped_swiglu_kernel", (T, -(-I // (THREADS * PER_THREAD))), (THREADS,),
                  (x, out, np.int32(I), np.float32(alpha), np.float32(limit)))
    return out
