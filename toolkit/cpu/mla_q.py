"""mla_q (CPU): the per-head absorb as one batched BLAS product, the rope by the Numba rope op
(toolkit/ref/mla_q.py is the spec)."""
import numpy as np

from ..layouts import deinterleave
from ..threads import blas_for
from .rope import rope


def mla_q(q, w_uk, positions, inv_freq, scale: float, interleave: bool) -> np.ndarray:
    B, T = positions.shape
    H, dn, r = w_uk.shape
    q = np.asarray(q, np.float32).reshape(B * T, H, -1)  # [N, H, dn + dr]
    dr = q.shape[-1] - dn
    out = np.empty((B, T, H, r + dr), np.float32)
    blas_for(B * T * H * dn * r)
    np.matmul(q[:, :, :dn].transpose(1, 0, 2), w_uk, out=out.reshape(B * T, H, -1)[:, :, :r].transpose(1, 0, 2))
    qr = q[:, :, dn:][..., deinterleave(dr)] if interleave else np.ascontiguousarray(q[:, :, dn:])
    out[..., r:] = rope(qr.reshape(B, T, H, dr), positions, inv_freq, scale)
    return out
