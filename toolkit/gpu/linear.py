"""cuda linear: launcher of ``cuda_src/linear.cu``. ``a f32 [M, K], w f32 [N, K] -> out f32 [M, N] = a @ w.T``.

The dense GEMM of the steps a plan records (a decode step, replayed, or captured as a CUDA graph: CuPy refuses
cuBLAS during stream capture), so that a step replayed eagerly and the same step in a graph give the same bits.
``Device.gemm`` picks it in a recorded step (``Device.linear_kernel``); eager GEMMs (prefill) stay on the device's
GEMM (cuBLAS).
One warp per output column; memory-bound for the decode batch (w read once per 8 rows of a).
"""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "linear"
KERNELS = ("linear_f32",)
WARPS = 4  # LINEAR_WARPS in the .cu


def check_linear(a, w, out) -> None:
    check_array("linear", "a", a, np.float32, ndim=2)
    check_array("linear", "w", w, np.float32, ndim=2)
    contract("linear", a.shape[1] == w.shape[1], f"a is {tuple(a.shape)} and w {tuple(w.shape)}: K differs")
    check_array("linear", "out", out, np.float32, shape=(a.shape[0], w.shape[0]))


def run_linear(rt, a, w, out):
    """``out [M, N] = a [M, K] @ w [N, K].T`` in f32, written into ``out``."""
    check_linear(a, w, out)
    (M, K), N = a.shape, w.shape[0]
    if M and N:
        rt.launch(SOURCE, "linear_f32", (-(-N // WARPS),), (32 * WARPS,), (a, w, out, np.int32(M), np.int32(N), np.int32(K)))
    return out
