"""silu_and_mul: ``[T, 2I] -> [T, I]``, ``silu(x[:, :I]) * x[:, I:]`` (gate first, then up)."""
import numpy as np


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    i = x.shape[-1] // 2
    g, u = x[..., :i], x[..., i:]
    return (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
