"""qlinear (Numba): ``x [T, K] f32`` @ quantized ``w [N, K]``.T -> ``[T, N]``: moe_gemm's kernels with one
expert (E = 1, every token one slot), so the same decode (T <= 8: GEMV, prange over blocks of output rows)
and prefill (tiled decode + BLAS) split applies. A small 16-bit weight at one token (a small model's LM head)
takes the plain 16-bit GEMV of ``toolkit/cpu/gemv_f32.py`` instead.
"""
import numpy as np

from . import igemm, moe_gemm
from .gemv_f32 import gemv_bf16, gemv_f16
from .moe_gemm import grouped_gemm, kernel_for


def qlinear(x, w, path=None, activations=None) -> np.ndarray:
    """``activations``: 'f32' or 'int8' (see ``toolkit/cpu/moe_gemm.py``; None: the kind ``w`` was prepared for)."""
    if len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"qlinear: need w [N, K] with K = {x.shape[-1]}, got {w.shape}")
    T = x.shape[0]
    if T == 1 and one_row_16(w):
        return _one_row_16(x, w)  # a small model's 16-bit LM head at one token
    kern = kernel_for(w.fmt)
    xa = np.ascontiguousarray(w.fmt.act_dequant(np.ascontiguousarray(x, dtype=np.float32), "numba"))  # [T, K]
    slots, zero, seg_hi, ones = _one_segment(T)
    if moe_gemm.int8_applies(w, activations):
        return igemm.grouped_igemm(w, xa, slots, zero, zero, seg_hi, ones, T)
    return grouped_gemm(kern, kern.prepare(w), xa, slots, zero, zero, seg_hi, ones, T, w.shape[0], path)


ONE_ROW_16_MAX = 1 << 22  # elements: below this a 16-bit weight at one token takes the plain GEMV (the parallel
# threshold's default, as its own constant: copied from ``_jit.PARALLEL_MIN_WORK`` at import, it took whatever value
# the warm-up or a test had set at the moment this module was first imported: 0 made the warm-up's LM head take the
# template GEMV, and the first real run compiled the plain one)


def one_row_16(w) -> bool:
    """Whether one token through ``w`` takes the plain 16-bit GEMV (a small dense 16-bit weight: below the
    parallel threshold, where the format's template GEMV compiles for seconds and gains nothing); the
    compiled decode step asks the same (toolkit/cpu/decode_layer.py), so both paths give the same bits."""
    return not w.fmt.quantized and w.fmt.bits == 16 and w.shape[0] * w.shape[1] < ONE_ROW_16_MAX


def _one_row_16(x, w) -> np.ndarray:
    a = w.arrays["weight"]
    y = np.empty((1, w.shape[0]), np.float32)
    gemv = gemv_bf16 if np.dtype(a.dtype).name == "bfloat16" else gemv_f16
    gemv(a.view(np.uint16), np.ascontiguousarray(x[0], np.float32), y[0])
    return y


_SEGMENTS: dict[int, tuple] = {}


def _one_segment(T: int) -> tuple:
    """(slots [T], expert 0 / segment start [1], segment end [1], unit scales [T]): all T rows one segment
    of expert 0; kept for the small T of decode steps (no kernel writes them). Writable, as the segments moe_gemm
    makes per call: Numba compiles one specialization per array flavour, and read-only ones here compiled every
    format's GEMV (serial and parallel, ~5 s each) a second time for the all-linear path."""
    if T in _SEGMENTS:
        return _SEGMENTS[T]
    seg = (np.arange(T, dtype=np.int64), np.zeros(1, np.int64), np.full(1, T, np.int64), np.ones(T, np.float32))
    if T <= 64:
        _SEGMENTS[T] = seg
    return seg
