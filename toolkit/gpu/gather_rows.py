"""cuda gather_rows: launcher of ``cuda_src/gather_rows.cu``. ``x f32 [R, C], rows int32 [n] -> [n, C]``.

``x[rows]`` (each sequence's last token); a row outside ``[0, R)`` gives zeros. The kernel copies 16-byte
units when ``C % 4 == 0`` and both bases are 16-byte aligned (it checks the pointers itself), else floats.
"""
from __future__ import annotations

import numpy as np

from .contract import check_array

SOURCE = "gather_rows"
KERNELS = ("gather_rows_kernel",)
THREADS, UNIT = 128, 4  # GATHER_THREADS in cuda_src/gather.cuh; floats per thread per pass


def check_gather_rows(x, rows, out) -> None:
    check_array("gather_rows", "x", x, np.float32, ndim=2)
    check_array("gather_rows", "rows", rows, np.int32, ndim=1)
    if out is not None:
        check_array("gather_rows", "out", out, np.float32, shape=(rows.shape[0], x.shape[1]))


def launch_gather(rt, source: str, kernel: str, x, rows, out):
    """``out [n, C] = x[rows]`` with a kernel built on ``cuda_src/gather.cuh`` (gather_rows, embedding)."""
    (n,), (R, C) = rows.shape, x.shape
    out = rt.xp.empty((n, C), np.float32) if out is None else out  # [n, C]
    if n and C:
        rt.launch(source, kernel, (n, -(-C // (UNIT * THREADS))), (THREADS,), (rows, x, out, np.int32(R), np.int32(C)))
    return out


def run_gather_rows(rt, x, rows, out=None):
    check_gather_rows(x, rows, out)
    return launch_gather(rt, SOURCE, "gather_rows_kernel", x, rows, out)
