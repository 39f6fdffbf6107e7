"""gated_add on the CPU: ``h += y + s * sigmoid(g)`` in place (``y`` or ``s`` may be None; ``g [R]`` or
``[R, 1]``); returns ``h``, as the CUDA kernel (cuda_src/gated_add.cu) does.

``gate_den`` is the gate's denominator ``1 + exp(-g)`` as the Numba backend computes it (exp in f64, rounded to
f32), here and in the compiled decode step (toolkit/cpu/decode_layer.py) alike: NumPy's f32 exp can differ
from it in the last bit, and the two decode paths give the same bits."""
import math

import numpy as np
from numba import njit


@njit(cache=True)
def gate_den(g):
    """``g [R, 1]`` f32 -> ``1 + exp(-g)`` ``[R, 1]`` f32."""
    out = np.empty_like(g)
    for r in range(g.shape[0]):
        out[r, 0] = np.float32(1.0) + np.float32(math.exp(-g[r, 0]))
    return out


def gated_add(h, y, s, g):
    if y is not None:
        h += y  # [R, C]
    if s is not None:
        h += s / gate_den(np.ascontiguousarray(g, np.float32).reshape(-1, 1))  # sigmoid gate [R, 1]
    return h
