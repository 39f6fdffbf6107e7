"""moe_experts: the routed experts of one MoE layer (SwiGLU), combined with the routing weights.

``x [T, D]``, ``ids [T, A]``, ``weights [T, A]``, ``gate_up [E, 2I, D]`` (gate rows first, then up),
``down [E, D, I]`` (dense f32 here; quantized experts decode to the same values) -> ``[T, D]``:
``y[t] = sum_a weights[t, a] * down[e] @ silu_and_mul(gate_up[e] @ x[t])`` with ``e = ids[t, a]``.
"""
import numpy as np


def moe_experts(x, ids, weights, gate_up, down, bias=None, act=None) -> np.ndarray:
    """``bias``: (gate_up bias [E, 2I], down bias [E, D]) or None; ``act``: see fused_moe.activation."""
    from .fused_moe import activation

    f = activation(act)
    out = np.zeros((x.shape[0], down.shape[1]), np.float32)  # [T, D]
    for e in range(gate_up.shape[0]):
        tok, slot = np.nonzero(ids == e)  # tokens routed to expert e
        if tok.size == 0:
            continue
        g = x[tok] @ gate_up[e].T  # [n, 2I]
        h = f(g + bias[0][e] if bias is not None else g)  # [n, I]
        y = h @ down[e].T + (bias[1][e] if bias is not None else 0)  # [n, D]
        np.add.at(out, tok, y * weights[tok, slot][:, None])
    return out
