"""cuda gated_add: launcher of ``cuda_src/gated_add.cu``, in place
``h f32 [R, C] += y f32 [R, C] + s f32 [R, C] * sigmoid(g f32 [R])`` (toolkit/ref/gated_add.py).

``y`` or ``s`` may be None (absent: a null pointer); ``g`` (``[R]`` or the gate linear's ``[R, 1]``) is needed
with ``s`` only.
"""
from __future__ import annotations

import numpy as np

from .contract import NULL, check_array, contract

SOURCE = "gated_add"
KERNELS = ("gated_add_kernel",)
THREADS = 256


def check_gated_add(h, y, s, g) -> None:
    check_array("gated_add", "h", h, np.float32, ndim=2)
    if y is not None:
        check_array("gated_add", "y", y, np.float32, shape=h.shape)
    if s is not None:
        check_array("gated_add", "s", s, np.float32, shape=h.shape)
        contract("gated_add", g is not None, "the shared expert's output s needs its gate g")
        check_array("gated_add", "g", g, np.float32)
        R = h.shape[0]
        contract("gated_add", tuple(g.shape) in ((R,), (R, 1)),
                 f"g.shape is {tuple(g.shape)}, expected ({R},) or ({R}, 1)")


def run_gated_add(rt, h, y, s=None, g=None) -> None:
    check_gated_add(h, y, s, g)
    R, C = h.shape
    if R and C and (y is not None or s is not None):
        rt.launch(SOURCE, "gated_add_kernel", (R, -(-C // THREADS)), (THREADS,),
                  (h, NULL if y is None else y, NULL if s is None else s, NULL if s is None else g, np.int32(C)))
