"""fused_moe (Numba): moe_align -> moe_gemm (GEMM1) -> silu_and_mul -> moe_gemm (GEMM2, routing weight in
the epilogue) -> moe_combine, each stage the Numba op of the same stem.

``x [T, D]``, ``topk_weights [T, A]``, ``topk_ids [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]``, ``down``
QTensor ``[E, D, I]`` -> ``[T, D]``. ``block_m`` only shapes the padding (the kernels work on compacted
segments): 16 at decode sizes (T*A/E <= 8), 64 otherwise. Per expert, moe_gemm picks the GEMV path for
<= 8 rows and the tiled BLAS path above (see toolkit/cpu/moe_gemm.py for the thread mapping).
One token with weight-only experts (the decode step) skips the alignment: each of its A experts is one
GEMV segment (``expert_rows``), then the A rows are summed.
"""
from .moe_align import moe_align
from .moe_combine import moe_combine
import numpy as np

from .moe_gemm import DECODE_MAX_ROWS, expert_rows, moe_gemm
from .silu_and_mul import silu_and_mul


def pick_block_m(T: int, A: int, E: int) -> int:
    return 16 if T * A <= DECODE_MAX_ROWS * E else 64


def fused_moe(x, topk_weights, topk_ids, gate_up, down, block_m: int | None = None, path=None):
    T, A = topk_ids.shape
    if T == 1 and path is None and gate_up.fmt.act_quant is None and down.fmt.act_quant is None:
        return _one_token(x, topk_weights, topk_ids[0], gate_up, down)
    bm = block_m or pick_block_m(T, A, gate_up.shape[0])
    sorted_ids, expert_ids, _ = moe_align(topk_ids, gate_up.shape[0], bm)
    h = moe_gemm(x, gate_up, sorted_ids, expert_ids, bm, A, path=path)  # [T*A, 2I]
    h = silu_and_mul(h)  # [T*A, I]
    y = moe_gemm(h, down, sorted_ids, expert_ids, bm, A, topk_weights, x_is_slots=True, path=path)  # [T*A, D]
    return moe_combine(y, A)  # [T, D]


def _one_token(x, topk_weights, ids, gate_up, down):
    """Decode: one token, its A distinct experts as one GEMV segment each (no alignment, no gather)."""
    A = ids.shape[0]
    h = expert_rows(np.broadcast_to(x, (A, x.shape[1])), gate_up, ids, np.ones(A, np.float32))  # [A, 2I]
    y = expert_rows(silu_and_mul(h), down, ids, np.ascontiguousarray(topk_weights, np.float32).reshape(-1))  # [A, D]
    return y.sum(axis=0, keepdims=True, dtype=np.float32)  # [1, D]
