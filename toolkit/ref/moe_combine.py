"""moe_combine: ``y [T*A, D]`` (one row per routed slot, routing weight already applied) -> ``[T, D]``,
the sum over each token's A slots."""
import numpy as np


def moe_combine(y, top_k: int) -> np.ndarray:
    return y.reshape(-1, top_k, y.shape[-1]).sum(axis=1, dtype=np.float32)  # [T, A, D] -> [T, D]
