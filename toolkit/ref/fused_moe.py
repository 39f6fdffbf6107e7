"""fused_moe: the routed experts of one MoE layer as named stages (vLLM fused_moe), reference version.

``x [T, D]``, ``topk_weights [T, A]``, ``topk_ids [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]`` (gate rows
first, then up), ``down`` QTensor ``[E, D, I]`` -> ``[T, D]``:
moe_align -> moe_gemm (GEMM1, [T*A, 2I]) -> silu_and_mul ([T*A, I]) -> moe_gemm (GEMM2, routing weight in
the epilogue, [T*A, D]) -> moe_combine ([T, D]). Equals moe_experts on the dequantized weights.
"""
from .moe_align import moe_align
from .moe_combine import moe_combine
from .moe_gemm import moe_gemm
from .silu_and_mul import silu_and_mul


def fused_moe(x, topk_weights, topk_ids, gate_up, down, block_m: int = 16):
    A = topk_ids.shape[1]
    sorted_ids, expert_ids, _ = moe_align(topk_ids, gate_up.shape[0], block_m)
    h = moe_gemm(x, gate_up, sorted_ids, expert_ids, block_m, A)  # [T*A, 2I]
    h = silu_and_mul(h)  # [T*A, I]
    y = moe_gemm(h, down, sorted_ids, expert_ids, block_m, A, topk_weights, x_is_slots=True)  # [T*A, D]
    return moe_combine(y, A)  # [T, D]
