"""cuda rope: launcher of ``cuda_src/rope.cu``, in place on ``x f32 [B, T, n, hd]``.

``positions int32 [B, T]``, ``inv_freq f32 [hd/2]``, ``scale``: the rotation of toolkit/ref/rope.py.
"""
from __future__ import annotations

import numpy as np

from .launch import check_array, contract

SOURCE = "rope"
KERNELS = ("rope_kernel",)
THREADS, MAX_HALF = 128, 256  # ROPE_THREADS, ROPE_MAX_HALF in the .cu


def check_rope(x, positions, inv_freq) -> None:
    check_array("rope", "x", x, np.float32, ndim=4)
    B, T, n, hd = x.shape
    contract("rope", hd % 2 == 0 and 0 < hd // 2 <= MAX_HALF, f"head dim {hd} must be even and at most {2 * MAX_HALF}")
    check_array("rope", "positions", positions, np.int32, shape=(B, T))
    check_array("rope", "inv_freq", inv_freq, np.float32, shape=(hd // 2,))


def run_rope(rt, x, positions, inv_freq, scale: float = 1.0) -> None:
    check_rope(x, positions, inv_freq)
    B, T, n, hd = x.shape
    if B * T and n:
        rt.launch(SOURCE, "rope_kernel", (B * T,), (THREADS,),
                  (x, positions, inv_freq, np.int32(n), np.int32(hd // 2), np.float32(scale)))
