"""mla_out (CPU): one batched BLAS product over the heads (toolkit/ref/mla_out.py)."""
import numpy as np

from ..threads import blas_for


def mla_out(att, w_uv) -> np.ndarray:
    H, r, dv = w_uv.shape
    a = np.asarray(att, np.float32).reshape(-1, H, att.shape[-1])[:, :, :r]  # [N, H, r]
    out = np.empty((a.shape[0], H, dv), np.float32)
    blas_for(a.shape[0] * H * r * dv)
    np.matmul(a.transpose(1, 0, 2), w_uv, out=out.transpose(1, 0, 2))
    return out.reshape(-1, H * dv)
