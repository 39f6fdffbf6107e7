"""cuda embedding: launcher of ``cuda_src/embedding.cu``. ``ids int32 [N], table f32 [V, D] -> [N, D]``.

``table[ids]``; an id outside ``[0, V)`` gives a row of zeros (never a read outside the table). The kernel
copies 16-byte units when ``D % 4 == 0`` and both bases are 16-byte aligned (it checks the pointers itself).
"""
from __future__ import annotations

import numpy as np

from .gather_rows import launch_gather
from .contract import check_array

SOURCE = "embedding"
KERNELS = ("embedding_kernel",)


def check_embedding(ids, table, out) -> None:
    check_array("embedding", "ids", ids, np.int32, ndim=1)
    check_array("embedding", "table", table, np.float32, ndim=2)
    if out is not None:
        check_array("embedding", "out", out, np.float32, shape=(ids.shape[0], table.shape[1]))


def run_embedding(rt, ids, table, out=None):
    check_embedding(ids, table, out)
    return launch_gather(rt, SOURCE, "embedding_kernel", table, ids, out)
