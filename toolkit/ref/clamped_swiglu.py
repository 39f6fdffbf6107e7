"""clamped_swiglu: gpt-oss's expert activation. ``x [T, 2I] -> [T, I]`` (gate first, then up):
``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``, ``out = (u + 1) * g * sigmoid(alpha * g)``."""
import numpy as np


def clamped_swiglu(x: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    i = x.shape[-1] // 2
    g = np.minimum(x[..., :i], np.float32(limit))
    u = np.clip(x[..., i:], -np.float32(limit), np.float32(limit))
    with np.errstate(over="ignore"):  # exp(-alpha g) overflows to inf for very negative g: the output is then -0
        return ((u + np.float32(1)) * (g / (np.float32(1) + np.exp(-np.float32(alpha) * g)))).astype(np.float32)
