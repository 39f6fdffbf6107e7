"""mla_q: the query of absorbed multi-head latent attention (DeepSeek-V2/V3), one row per head over the cache's
latent rows. ``q [B*T, H*(dn+dr)]`` (the q projection: per head dn no-rope dims, then dr rope dims), ``w_uk
[H, dn, r]`` (each head's key up-projection, from kv_b_proj), ``positions [B, T]``, ``inv_freq [dr/2]``, ``scale``
(rope's attention factor), ``interleave`` (the checkpoint's rope dims are pairs (x0, x1), (x2, x3), ...) ->
``qf [B, T, H, r + dr]``: ``qf[..., :r] = q_nope @ w_uk[h]``, ``qf[..., r:] = rope(q_rope)`` in rotate-half order.
"""
import numpy as np

from ..layouts import deinterleave
from .rope import rope


def mla_q(q, w_uk, positions, inv_freq, scale: float, interleave: bool) -> np.ndarray:
    B, T = positions.shape
    H, dn, r = w_uk.shape
    q = np.asarray(q, np.float32).reshape(B * T, H, -1)  # [N, H, dn + dr]
    dr = q.shape[-1] - dn
    lat = np.matmul(q[:, :, :dn].transpose(1, 0, 2), w_uk).transpose(1, 0, 2)  # [N, H, r]
    qr = q[:, :, dn:][..., deinterleave(dr)] if interleave else q[:, :, dn:]
    qr = rope(np.ascontiguousarray(qr).reshape(B, T, H, dr), positions, inv_freq, scale)  # [B, T, H, dr]
    return np.concatenate([lat.reshape(B, T, H, r), qr], axis=-1).astype(np.float32)
