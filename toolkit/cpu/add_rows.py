"""add_rows on the CPU: ``h[rows[i]] += y[i]`` in place (rows distinct; one outside ``[0, R)`` adds nothing);
returns ``h``, as the CUDA kernel (cuda_src/add_rows.cu) does."""
import numpy as np


def add_rows(h, y, rows):
    rows = np.asarray(rows)
    valid = (rows >= 0) & (rows < h.shape[0])  # [n]
    if valid.all():
        h[rows] += y  # [n, C]
    else:
        h[rows[valid]] += y[valid]
    return h
