"""mla_out: absorbed MLA's attention output back to per-head values. ``att [B, T, H, r + dr]`` (attention over the
latent rows; only the first r values, the latent, are the value), ``w_uv [H, r, dv]`` (each head's value
up-projection) -> ``[B*T, H*dv]``, the input of o_proj: ``out[n, h] = att[n, h, :r] @ w_uv[h]``."""
import numpy as np


def mla_out(att, w_uv) -> np.ndarray:
    H, r, dv = w_uv.shape
    a = np.asarray(att, np.float32).reshape(-1, H, att.shape[-1])[:, :, :r]  # [N, H, r]
    out = np.matmul(a.transpose(1, 0, 2), w_uv).transpose(1, 0, 2)  # [N, H, dv]
    return np.ascontiguousarray(out.reshape(-1, H * dv), dtype=np.float32)
