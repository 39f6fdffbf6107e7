"""rms_norm: ``[T, D] -> [T, D]``, ``y = x / sqrt(mean(x**2) + eps) * w`` (in f32)."""
import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True)  # [T, 1]
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * w
