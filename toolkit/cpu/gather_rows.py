"""gather_rows on the CPU: ``x [R, C], rows [n] -> x[rows] [n, C]`` (each sequence's last token); a row index
outside ``[0, R)`` gives a row of zeros, as the reference and the CUDA kernel do."""
import numpy as np


def gather_rows(x, rows):
    rows = np.asarray(rows)
    if rows.size and (rows.min() < 0 or rows.max() >= x.shape[0]):
        valid = (rows >= 0) & (rows < x.shape[0])  # [n]
        out = np.zeros((len(rows), x.shape[1]), np.float32)
        out[valid] = x[rows[valid]]
        return out
    return x[rows]  # [n, C]
