"""mla_kv (CPU): the cached row of absorbed MLA with the Numba rms_norm and rope ops (toolkit/ref/mla_kv.py)."""
import numpy as np

from ..layouts import deinterleave
from .rms_norm import rms_norm
from .rope import rope


def mla_kv(kv, norm_w, eps: float, positions, inv_freq, scale: float, interleave: bool) -> np.ndarray:
    B, T = positions.shape
    r = norm_w.shape[0]
    kv = np.asarray(kv, np.float32)
    dr = kv.shape[1] - r
    out = np.empty((B, T, 1, r + dr), np.float32)
    out[..., :r] = rms_norm(np.ascontiguousarray(kv[:, :r]), norm_w, eps).reshape(B, T, 1, r)
    kr = kv[:, r:][:, deinterleave(dr)] if interleave else np.ascontiguousarray(kv[:, r:])
    out[..., r:] = rope(kr.reshape(B, T, 1, dr), positions, inv_freq, scale)
    return out
