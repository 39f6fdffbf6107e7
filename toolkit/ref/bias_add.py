"""bias_add: ``x [R, C] + b [C] -> [R, C]`` in f32 (the q/k/v biases of Qwen2)."""
import numpy as np


def bias_add(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (x + b[None, :]).astype(np.float32)  # [R, C]
