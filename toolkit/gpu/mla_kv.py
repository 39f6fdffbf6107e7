"""cuda mla_kv: launcher of ``cuda_src/mla_kv.cu`` (spec: toolkit/ref/mla_kv.py)."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "mla_kv"
KERNELS = ("mla_kv_kernel",)
THREADS = 256


def run_mla_kv(rt, kv, norm_w, eps: float, positions, inv_freq, scale: float, interleave: bool):
    """``kv [B*T, r + dr]``, ``norm_w [r]``, ``positions int32 [B, T]`` -> ``row [B, T, 1, r + dr]``."""
    check_array("mla_kv", "norm_w", norm_w, np.float32, ndim=1)
    r = norm_w.shape[0]
    check_array("mla_kv", "positions", positions, np.int32, ndim=2)
    B, T = positions.shape
    check_array("mla_kv", "kv", kv, np.float32, ndim=2)
    dr = kv.shape[1] - r
    contract("mla_kv", kv.shape[0] == B * T and dr > 0 and dr % 2 == 0,
             f"kv.shape is {tuple(kv.shape)}: expected ({B * T}, r + dr) with r={r} and an even dr")
    check_array("mla_kv", "inv_freq", inv_freq, np.float32, shape=(dr // 2,))
    row = rt.xp.empty((B, T, 1, r + dr), np.float32)
    if B * T:
        rt.launch(SOURCE, "mla_kv_kernel", (B * T,), (THREADS,),
                  (kv, norm_w, positions, inv_freq, row, np.int32(r), np.int32(dr), np.float32(eps), np.float32(scale),
                   np.int32(bool(interleave))))
    return row
