"""mla_kv: the row absorbed MLA caches per token. ``kv [B*T, r + dr]`` (kv_a_proj's output: latent, then rope key),
``norm_w [r]`` (kv_a_layernorm), ``eps``, ``positions [B, T]``, ``inv_freq [dr/2]``, ``scale``, ``interleave``
-> ``row [B, T, 1, r + dr]``: ``rms_norm(latent) * norm_w``, then ``rope(k_rope)`` in rotate-half order. The row is
the key of the single KV head, and its first r values the value."""
import numpy as np

from ..layouts import deinterleave
from .rms_norm import rms_norm
from .rope import rope


def mla_kv(kv, norm_w, eps: float, positions, inv_freq, scale: float, interleave: bool) -> np.ndarray:
    B, T = positions.shape
    r = norm_w.shape[0]
    kv = np.asarray(kv, np.float32)
    dr = kv.shape[1] - r
    lat = rms_norm(np.ascontiguousarray(kv[:, :r]), norm_w, eps)  # [N, r]
    kr = kv[:, r:][:, deinterleave(dr)] if interleave else kv[:, r:]
    kr = rope(np.ascontiguousarray(kr).reshape(B, T, 1, dr), positions, inv_freq, scale)  # [B, T, 1, dr]
    return np.concatenate([lat.reshape(B, T, 1, r), kr], axis=-1).astype(np.float32)
