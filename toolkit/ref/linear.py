"""linear: a dense projection, ``x [T, K] f32``, ``w [N, K] f32``, ``b [N]`` or None -> ``[T, N] = x @ w.T (+ b)``
in f32 (attention's dense projections, the LM head, a shared expert's f32 MLP)."""
import numpy as np


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T  # [T, N]
    return y if b is None else (y + b).astype(np.float32)
