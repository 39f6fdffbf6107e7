"""cuda add_rows: launcher of ``cuda_src/add_rows.cu``, in place ``h f32 [R, C] += y f32 [n, C]`` at ``rows
int32 [n]`` (distinct; a row outside ``[0, R)`` adds nothing)."""
from __future__ import annotations

import numpy as np

from .contract import check_array

SOURCE = "add_rows"
KERNELS = ("add_rows_kernel",)
THREADS = 256  # ADD_ROWS_THREADS in cuda_src/add_rows.cu


def check_add_rows(h, y, rows) -> None:
    check_array("add_rows", "h", h, np.float32, ndim=2)
    check_array("add_rows", "rows", rows, np.int32, ndim=1)
    check_array("add_rows", "y", y, np.float32, shape=(rows.shape[0], h.shape[1]))


def run_add_rows(rt, h, y, rows) -> None:
    check_add_rows(h, y, rows)
    (n,), (R, C) = rows.shape, h.shape
    if n and C:
        rt.launch(SOURCE, "add_rows_kernel", (n, -(-C // THREADS)), (THREADS,), (h, y, rows, np.int32(R), np.int32(C)))
