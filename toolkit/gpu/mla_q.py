"""cuda mla_q / mla_kv / mla_out: launchers of ``cuda_src/mla_q.cu``, ``mla_kv.cu`` and ``mla_out.cu``, absorbed
multi-head latent attention's stages around kv_attention (specs: toolkit/ref/mla_q.py, mla_kv.py, mla_out.py)."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "mla_q"
KERNELS = ("mla_q_kernel",)
THREADS, MAX_DN = 128, 512


def run_mla_q(rt, q, w_uk, positions, inv_freq, scale: float, interleave: bool):
    """``q [B*T, H*(dn+dr)]``, ``w_uk [H, dn, r]``, ``positions int32 [B, T]`` -> ``qf [B, T, H, r + dr]``."""
    check_array("mla_q", "w_uk", w_uk, np.float32, ndim=3)
    H, dn, r = w_uk.shape
    check_array("mla_q", "positions", positions, np.int32, ndim=2)
    B, T = positions.shape
    check_array("mla_q", "q", q, np.float32, ndim=2)
    dr = q.shape[1] // H - dn
    contract("mla_q", q.shape[0] == B * T and q.shape[1] == H * (dn + dr) and dr > 0 and dr % 2 == 0,
             f"q.shape is {tuple(q.shape)}: expected ({B * T}, H*(dn+dr)) with H={H}, dn={dn} and an even dr")
    contract("mla_q", dn <= MAX_DN, f"dn={dn} exceeds {MAX_DN}")
    check_array("mla_q", "inv_freq", inv_freq, np.float32, shape=(dr // 2,))
    qf = rt.xp.empty((B, T, H, r + dr), np.float32)
    if B * T:
        rt.launch(SOURCE, "mla_q_kernel", (B * T, H), (THREADS,),
                  (q, w_uk, positions, inv_freq, qf, np.int32(H), np.int32(dn), np.int32(dr), np.int32(r),
                   np.float32(scale), np.int32(bool(interleave))))
    return qf
