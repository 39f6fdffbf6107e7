"""add_rows: ``h [R, C] += y [n, C]`` at rows ``rows [n]`` (distinct): ``h[rows[i]] += y[i]``; a row index outside
``[0, R)`` adds nothing. The host experts' output added back into the device's ``[T, D]`` (hybrid placement:
only the rows routed to host experts cross the bus, ``toolkit/model/moe.py``)."""
import numpy as np


def add_rows(h: np.ndarray, y: np.ndarray, rows: np.ndarray) -> np.ndarray:
    R, _ = h.shape
    rows = np.asarray(rows)
    valid = (rows >= 0) & (rows < R)  # [n]
    out = h.astype(np.float32)  # [R, C]
    out[rows[valid]] += y[valid]
    return out
