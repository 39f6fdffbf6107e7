"""cuda moe_bias_add: launcher of ``cuda_src/moe_bias_add.cu``, in place: ``y f32 [T*A, N] += w * bias[ids]``
(toolkit/ref/moe_bias_add.py); slots with id -1 are left alone."""
from __future__ import annotations

import numpy as np

from .contract import NULL, check_array, contract

SOURCE = "moe_bias_add"
KERNELS = ("moe_bias_add_kernel",)
THREADS = 256


def run_moe_bias_add(rt, y, bias, ids, weights=None):
    op = "moe_bias_add"
    check_array(op, "ids", ids, np.int32, ndim=2)
    T, A = ids.shape
    check_array(op, "y", y, np.float32, ndim=2)
    contract(op, y.shape[0] == T * A, f"y has {y.shape[0]} rows, ids [T, A] = [{T}, {A}] implies {T * A}")
    N = y.shape[1]
    check_array(op, "bias", bias, np.float32, ndim=2)
    contract(op, bias.shape[1] == N, f"bias.shape is {tuple(bias.shape)}, expected (E, {N})")
    if weights is not None:
        check_array(op, "weights", weights, np.float32, shape=(T, A))
    if T * A and N:
        rt.launch(SOURCE, "moe_bias_add_kernel", (T * A, -(-N // THREADS)), (THREADS,),
                  (y, bias, ids, NULL if weights is None else weights, np.int32(N)))
    return y
