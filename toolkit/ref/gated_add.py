"""gated_add: the MoE output added to the residual, Qwen2-MoE style (toolkit/model/model.py, MoEBlock):

``h [R, C] + (y [R, C] + s [R, C] / (1 + exp(-g [R]))) -> [R, C]`` in f32, where ``y`` is the routed experts'
sum and ``s`` the shared expert's output gated by ``sigmoid(g)`` (``g [R]`` or ``[R, 1]``). ``y`` or ``s`` may be
absent (None).
The operations and their order are the model's: the gate divides ``s``, ``y`` is added, then ``h``.
"""
import numpy as np


def gated_add(h: np.ndarray, y: np.ndarray | None, s: np.ndarray | None, g: np.ndarray | None) -> np.ndarray:
    v = np.zeros_like(h) if y is None else y  # [R, C]
    if s is not None:
        v = v + s / (np.float32(1) + np.exp(-g.reshape(-1, 1)))  # sigmoid gate [R, 1]
    return (h + v).astype(np.float32)
