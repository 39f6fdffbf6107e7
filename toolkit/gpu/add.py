"""cuda add: launcher of ``cuda_src/add.cu``, in place ``h f32 [...] += y f32 [...]`` (same shape, flattened)."""
from __future__ import annotations

import numpy as np

from .contract import check_array

SOURCE = "add"
KERNELS = ("add_kernel",)
THREADS = 256


def check_add(h, y) -> None:
    check_array("add", "h", h, np.float32)
    check_array("add", "y", y, np.float32, shape=h.shape)


def run_add(rt, h, y) -> None:
    check_add(h, y)
    n = h.size
    if n:
        rt.launch(SOURCE, "add_kernel", (-(-n // THREADS),), (THREADS,), (h, y, np.int64(n)))
