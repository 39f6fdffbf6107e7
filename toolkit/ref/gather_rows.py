"""gather_rows: ``x [R, C], rows [n] -> [n, C]``, the rows ``x[rows]`` (each sequence's last token before the
final norm and the LM head); a row index outside ``[0, R)`` gives a row of zeros."""
import numpy as np


def gather_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    R, C = x.shape
    valid = (rows >= 0) & (rows < R)  # [n]
    out = np.zeros((len(rows), C), np.float32)  # [n, C]
    out[valid] = x[rows[valid]]
    return out
