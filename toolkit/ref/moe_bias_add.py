"""moe_bias_add: per-expert biases on the rows of a grouped GEMM's output, in slot order.

``y [T*A, N]`` (row ``t*A + a`` belongs to token t's a-th expert), ``bias [E, N]``, ``ids [T, A]``,
``weights [T, A]`` or None -> ``y[t*A + a] += w * bias[ids[t, a]]`` with ``w = weights[t, a]`` (1 without): after
GEMM1 without weights, after GEMM2 (whose epilogue applied the routing weight) with them. In place; returns y.
A slot whose id is -1 (its expert is not in this call: fused_moe's ``expert_map``) gets nothing.
"""
import numpy as np


def moe_bias_add(y: np.ndarray, bias: np.ndarray, ids: np.ndarray, weights=None) -> np.ndarray:
    flat = np.asarray(ids).reshape(-1)  # [T*A]
    add = np.asarray(bias, np.float32)[np.maximum(flat, 0)]  # [T*A, N]
    if weights is not None:
        add = add * np.asarray(weights, np.float32).reshape(-1, 1)
    add[flat < 0] = 0.0
    y += add
    return y
