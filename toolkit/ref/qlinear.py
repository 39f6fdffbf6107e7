"""qlinear: a dense linear with a quantized weight, ``x [T, K] f32``, ``w`` QTensor ``[N, K]`` -> ``[T, N]``
(``x @ dequant(w).T``; W8A8 formats quantize the activation rows as moe_gemm does)."""
import numpy as np


def qlinear(x, w) -> np.ndarray:
    xa = w.fmt.act_dequant(np.asarray(x, np.float32), "numpy")  # [T, K]
    return (xa @ w.dequantize("numpy").T).astype(np.float32)  # [T, N]
