"""fused_moe (Numba): moe_align -> moe_gemm (GEMM1) -> silu_and_mul -> moe_gemm (GEMM2, routing weight in
the epilogue) -> moe_combine, each stage the Numba op of the same stem.

``x [T, D]``, ``topk_weights [T, A]``, ``topk_ids [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]``, ``down``
QTensor ``[E, D, I]`` -> ``[T, D]``. ``block_m`` only shapes the padding (the kernels work on compacted
segments): 16 at decode sizes (T*A/E <= 8), 64 otherwise. Per expert, moe_gemm picks the GEMV path for
<= 8 rows and the tiled BLAS path above (see toolkit/cpu/moe_gemm.py for the thread mapping).
"""
from .moe_align import moe_align
from .moe_combine import moe_combine
from .moe_gemm import DECODE_MAX_ROWS, moe_gemm
from .silu_and_mul import silu_and_mul


def pick_block_m(T: int, A: int, E: int) -> int:
    return 16 if T * A <= DECODE_MAX_ROWS * E else 64


def fused_moe(x, topk_weights, topk_ids, gate_up, down, block_m: int | None = None, path=None):
    T, A = topk_ids.shape
    bm = block_m or pick_block_m(T, A, gate_up.shape[0])
    sorted_ids, expert_ids, _ = moe_align(topk_ids, gate_up.shape[0], bm)
    h = moe_gemm(x, gate_up, sorted_ids, expert_ids, bm, A, path=path)  # [T*A, 2I]
    h = silu_and_mul(h)  # [T*A, I]
    y = moe_gemm(h, down, sorted_ids, expert_ids, bm, A, topk_weights, x_is_slots=True, path=path)  # [T*A, D]
    return moe_combine(y, A)  # [T, D]
