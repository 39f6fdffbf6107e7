"""gated_add on the CPU backends: the NumPy reference itself (toolkit/ref/gated_add.py). A memory-bound gather or
elementwise step has no faster Numba form than NumPy's; the CPU runtime (toolkit/model/runtime.py) inlines
the same expressions in place. The CUDA kernel (cuda_src/gated_add.cu) is tested against this reference.

``gate_den`` is the gate's denominator ``1 + exp(-g)`` as the Numba backend computes it (exp in f64, rounded to
f32), in the staged runtime and in the compiled decode step (toolkit/cpu/decode_layer.py) alike: NumPy's f32
exp can differ from it in the last bit, and the two decode paths give the same bits."""
import math

import numpy as np
from numba import njit

from ..ref.gated_add import gated_add  # noqa: F401


@njit(cache=True)
def gate_den(g):
    """``g [R, 1]`` f32 -> ``1 + exp(-g)`` ``[R, 1]`` f32."""
    out = np.empty_like(g)
    for r in range(g.shape[0]):
        out[r, 0] = np.float32(1.0) + np.float32(math.exp(-g[r, 0]))
    return out
