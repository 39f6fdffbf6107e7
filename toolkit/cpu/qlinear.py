"""qlinear (Numba): ``x [T, K] f32`` @ quantized ``w [N, K]``.T -> ``[T, N]``: moe_gemm's kernels with one
expert (E = 1, every token one slot), so the same decode (T <= 8: GEMV, prange over blocks of output rows)
and prefill (tiled decode + BLAS) split applies.
"""
import numpy as np

from ..ref.moe_gemm import act_dequant
from . import igemm, moe_gemm
from .moe_gemm import grouped_gemm, kernel_for


def qlinear(x, w, path=None, activations=None) -> np.ndarray:
    """``activations``: 'f32' or 'int8' (see ``toolkit/cpu/moe_gemm.py``; None: ``moe_gemm.ACTIVATIONS``)."""
    if len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"qlinear: need w [N, K] with K = {x.shape[-1]}, got {w.shape}")
    kern = kernel_for(w.fmt)
    T = x.shape[0]
    xa = np.ascontiguousarray(act_dequant(np.ascontiguousarray(x, dtype=np.float32), w.fmt, "numba"))  # [T, K]
    slots = np.arange(T, dtype=np.int64)
    one = np.zeros(1, np.int64)
    seg_hi = np.full(1, T, np.int64)
    if moe_gemm.int8_applies(w, activations):
        return igemm.grouped_igemm(w, xa, slots, one, one, seg_hi, np.ones(T, np.float32), T)
    return grouped_gemm(kern, kern.prepare(w), xa, slots, one, one, seg_hi, np.ones(T, np.float32), T, w.shape[0], path)
