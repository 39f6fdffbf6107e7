"""cuda mla_out: launcher of ``cuda_src/mla_out.cu`` (spec: toolkit/ref/mla_out.py)."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "mla_out"
KERNELS = ("mla_out_kernel",)
THREADS, MAX_R = 128, 1024


def run_mla_out(rt, att, w_uv):
    """``att [B, T, H, r + dr]``, ``w_uv [H, r, dv]`` -> ``[B*T, H*dv]``."""
    check_array("mla_out", "w_uv", w_uv, np.float32, ndim=3)
    H, r, dv = w_uv.shape
    check_array("mla_out", "att", att, np.float32, ndim=4)
    contract("mla_out", att.shape[2] == H and att.shape[3] >= r, f"att.shape is {tuple(att.shape)}: expected (B, T, {H}, >= {r})")
    contract("mla_out", r <= MAX_R, f"r={r} exceeds {MAX_R}")
    N = att.shape[0] * att.shape[1]
    out = rt.xp.empty((N, H * dv), np.float32)
    if N:
        rt.launch(SOURCE, "mla_out_kernel", (N, H), (THREADS,), (att, w_uv, out, np.int32(H), np.int32(r),
                                                                np.int32(att.shape[3]), np.int32(dv)))
    return out
