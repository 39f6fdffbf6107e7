"""cuda fp8_act_quant: launcher of ``cuda_src/fp8_act_quant.cu``.

``x f32 [T, K] -> (q uint8 [T, K] e4m3 codes, s f32 [T])``, bit-identical to
``toolkit.formats.fp8.fp8_act_quant_ref``; the first stage of a W8A8 moe_gemm.
"""
from __future__ import annotations

import numpy as np

from .contract import check_array

SOURCE = "fp8_act_quant"
KERNELS = ("fp8_act_quant_kernel",)
THREADS = 256


def check_fp8_act_quant(x) -> None:
    check_array("fp8_act_quant", "x", x, np.float32, ndim=2)


def run_fp8_act_quant(rt, x):
    check_fp8_act_quant(x)
    T, K = x.shape
    q = rt.xp.empty((T, K), np.uint8)  # [T, K]
    s = rt.xp.empty((T,), np.float32)  # [T]
    if T:
        rt.launch(SOURCE, "fp8_act_quant_kernel", (T,), (THREADS,), (x, q, s, np.int32(K)))
    return q, s

