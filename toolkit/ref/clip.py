"""clip: ``x`` clamped to ``[-c, c]`` in f32 (any shape; OLMoE's ``clip_qkv`` on q, k and v)."""
import numpy as np


def clip(x: np.ndarray, c: float) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -np.float32(c), np.float32(c)).astype(np.float32)
