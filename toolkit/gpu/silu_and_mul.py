"""cuda silu_and_mul: launcher of ``cuda_src/silu_and_mul.cu``. ``x f32 [T, 2I] -> [T, I]``."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "silu_and_mul"
KERNELS = ("silu_and_mul_kernel",)
THREADS, PER_THREAD = 256, 4


def check_silu_and_mul(x) -> None:
    check_array("silu_and_mul", "x", x, np.float32, ndim=2)
    contract("silu_and_mul", x.shape[1] % 2 == 0, f"x.shape[1]={x.shape[1]} must be even (gate then up)")


def run_silu_and_mul(rt, x):
    check_silu_and_mul(x)
    T, I = x.shape[0], x.shape[1] // 2
    out = rt.xp.empty((T, I), np.float32)  # [T, I]
    if T and I:
        rt.launch(SOURCE, "silu_and_mul_kernel", (T, -(-I // (THREADS * PER_THREAD))), (THREADS,), (x, out, np.int32(I)))
    return out

