"""rope: rotary position embedding, the "rotate half" convention of Llama/Mixtral/Qwen.

``x [B, T, n, hd]``, ``positions [B, T]`` (absolute), ``inv_freq [hd/2]`` -> ``[B, T, n, hd]``:
``angle = pos * inv_freq``; with ``c = cos(angle) * scale``, ``s = sin(angle) * scale``:
``y[:hd/2] = x1 * c - x2 * s`` and ``y[hd/2:] = x2 * c + x1 * s`` (x1, x2 the two halves).
"""
import numpy as np


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
    half = x.shape[-1] // 2
    ang = positions[..., None].astype(np.float32) * inv_freq.astype(np.float32)  # [B, T, hd/2]
    c = (np.cos(ang) * np.float32(scale))[:, :, None, :]  # [B, T, 1, hd/2]
    s = (np.sin(ang) * np.float32(scale))[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)
