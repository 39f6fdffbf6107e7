"""cuda rms_norm: launcher of ``cuda_src/rms_norm.cu``. ``x f32 [T, D], w f32 [D], eps -> [T, D]``."""
from __future__ import annotations

import numpy as np

from .contract import check_array

SOURCE = "rms_norm"
KERNELS = ("rms_norm_kernel",)
THREADS = 256


def check_rms_norm(x, w) -> None:
    check_array("rms_norm", "x", x, np.float32, ndim=2)
    check_array("rms_norm", "w", w, np.float32, shape=(x.shape[1],))


def run_rms_norm(rt, x, w, eps: float):
    check_rms_norm(x, w)
    T, D = x.shape
    y = rt.xp.empty((T, D), np.float32)  # [T, D]
    if T:
        rt.launch(SOURCE, "rms_norm_kernel", (T,), (THREADS,), (x, w, y, np.int32(D), np.float32(eps)))
    return y

