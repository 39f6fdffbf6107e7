"""embedding: ``ids [N], table [V, D] -> [N, D]``, the rows ``table[ids]``; an id outside ``[0, V)`` gives a
row of zeros (the host validates ids; the CUDA kernel must never read outside the table)."""
import numpy as np


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    V, D = table.shape
    valid = (ids >= 0) & (ids < V)  # [N]
    out = np.zeros((len(ids), D), np.float32)  # [N, D]
    out[valid] = table[ids[valid]]
    return out
