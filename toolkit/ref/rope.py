"""rope: rotary position embedding, the "rotate half" convention of Llama/Mixtral/Qwen.

``x [B, T, n, hd]``, ``positions [B, T]`` (absolute), ``inv_freq [rd/2]`` -> ``[B, T, n, hd]``:
``angle = pos * inv_freq``; with ``c = cos(angle) * scale``, ``s = sin(angle) * scale``:
``y[:rd/2] = x1 * c - x2 * s`` and ``y[rd/2:rd] = x2 * c + x1 * s`` (x1, x2 the two halves of the first rd dims).
``rd = 2 * len(inv_freq)`` is the head dim, or less for partial rotary (GLM-4.5: half of it): the dims past rd
pass through unchanged.
"""
import numpy as np


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
    half = inv_freq.shape[0]
    ang = positions[..., None].astype(np.float32) * inv_freq.astype(np.float32)  # [B, T, rd/2]
    c = (np.cos(ang) * np.float32(scale))[:, :, None, :]  # [B, T, 1, hd/2]
    s = (np.sin(ang) * np.float32(scale))[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], axis=-1).astype(np.float32)
