"""moe_experts: the routed experts of one MoE layer (SwiGLU), combined with the routing weights.

``x [T, D]``, ``ids [T, A]``, ``weights [T, A]``, ``gate_up [E, 2I, D]`` (gate rows first, then up),
``down [E, D, I]`` (dense f32 here; quantized experts decode to the same values) -> ``[T, D]``:
``y[t] = sum_a weights[t, a] * down[e] @ silu_and_mul(gate_up[e] @ x[t])`` with ``e = ids[t, a]``.
"""
import numpy as np

from .silu_and_mul import silu_and_mul


def moe_experts(x, ids, weights, gate_up, down) -> np.ndarray:
    out = np.zeros((x.shape[0], down.shape[1]), np.float32)  # [T, D]
    for e in range(gate_up.shape[0]):
        tok, slot = np.nonzero(ids == e)  # tokens routed to expert e
        if tok.size == 0:
            continue
        h = silu_and_mul(x[tok] @ gate_up[e].T)  # [n, I]
        y = h @ down[e].T  # [n, D]
        np.add.at(out, tok, y * weights[tok, slot][:, None])
    return out
