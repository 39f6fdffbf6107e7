"""cuda bias_add: launcher of ``cuda_src/bias_add.cu``, in place ``x f32 [R, C] += b f32 [C]``."""
from __future__ import annotations

import numpy as np

from .contract import check_array

SOURCE = "bias_add"
KERNELS = ("bias_add_kernel",)
THREADS = 256


def check_bias_add(x, b) -> None:
    check_array("bias_add", "x", x, np.float32, ndim=2)
    check_array("bias_add", "b", b, np.float32, shape=(x.shape[1],))


def run_bias_add(rt, x, b) -> None:
    check_bias_add(x, b)
    R, C = x.shape
    if R and C:
        rt.launch(SOURCE, "bias_add_kernel", (R, -(-C // THREADS)), (THREADS,), (x, b, np.int32(C)))
