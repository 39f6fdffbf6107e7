"""clip on the CPU: ``x`` clamped to ``[-c, c]`` (OLMoE's clip_qkv), a new f32 array."""
import numpy as np


def clip(x, c: float):
    return np.clip(x, -np.float32(c), np.float32(c))  # [R, C]
