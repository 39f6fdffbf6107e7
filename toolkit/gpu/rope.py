"""cuda rope: launcher of ``cuda_src/rope.cu``, in place on ``x f32 [B, T, n, hd]``.

``positions int32 [B, T]``, ``inv_freq f32 [rd/2]`` (rd <= hd: partial rotary), ``scale``: the rotation of
toolkit/ref/rope.py.
"""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "rope"
KERNELS = ("rope_kernel",)
THREADS, MAX_HALF = 128, 256  # ROPE_THREADS, ROPE_MAX_HALF in the .cu


def check_rope(x, positions, inv_freq) -> None:
    check_array("rope", "x", x, np.float32, ndim=4)
    B, T, n, hd = x.shape
    check_array("rope", "positions", positions, np.int32, shape=(B, T))
    check_array("rope", "inv_freq", inv_freq, np.float32, ndim=1)
    half = inv_freq.shape[0]  # rotary dims / 2: hd / 2, or less for partial rotary
    contract("rope", 0 < half <= MAX_HALF and 2 * half <= hd,
             f"inv_freq has {half} frequencies: need 1..{MAX_HALF} and 2 x {half} <= head dim {hd}")


def run_rope(rt, x, positions, inv_freq, scale: float = 1.0) -> None:
    check_rope(x, positions, inv_freq)
    B, T, n, hd = x.shape
    if B * T and n:
        rt.launch(SOURCE, "rope_kernel", (B * T,), (THREADS,),
                  (x, positions, inv_freq, np.int32(n), np.int32(inv_freq.shape[0]), np.int32(hd), np.float32(scale)))
