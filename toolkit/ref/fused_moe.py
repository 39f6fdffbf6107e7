"""fused_moe: the routed experts of one MoE layer as named stages (vLLM fused_moe), reference version.

``x [T, D]``, ``topk_weights [T, A]``, ``topk_ids [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]`` (gate rows
first, then up), ``down`` QTensor ``[E, D, I]`` -> ``[T, D]``:
moe_align -> moe_gemm (GEMM1, [T*A, 2I]) (-> moe_bias_add) -> silu_and_mul or clamped_swiglu ([T*A, I]) -> moe_gemm (GEMM2, routing weight in
the epilogue, [T*A, D]) -> moe_combine ([T, D]). Equals moe_experts on the dequantized weights.

``expert_map int32 [E_total]`` or None (vLLM's, as for expert parallelism): ``topk_ids`` hold global expert ids,
``gate_up [E_local, 2I, D]`` / ``down [E_local, D, I]`` only this call's experts, and ``expert_map[e]`` is expert
e's local index, or -1 when it is not in this call; such slots contribute nothing (their rows of the slot
intermediates stay zero), so the calls over a partition of the experts (one per storage format of a mixed-width
layer) sum to the whole layer. ``bias`` is then local too (``[E_local, ...]``), indexed by the local ids.
"""
from ..layouts import remap_experts
from .clamped_swiglu import clamped_swiglu
from .moe_align import moe_align
from .moe_bias_add import moe_bias_add
from .moe_combine import moe_combine
from .moe_gemm import moe_gemm
from .silu_and_mul import silu_and_mul


def activation(act):
    """The expert activation part: None -> silu_and_mul (SwiGLU); ("clamped_swiglu", alpha, limit) -> gpt-oss's."""
    if act is None:
        return silu_and_mul
    name, alpha, limit = act
    return lambda h: clamped_swiglu(h, alpha, limit)


def fused_moe(x, topk_weights, topk_ids, gate_up, down, bias=None, act=None, block_m: int = 16, expert_map=None):
    """``bias``: (gate_up bias [E, 2I], down bias [E, D]) or None, added per expert on the slot rows."""
    A = topk_ids.shape[1]
    if expert_map is not None:
        topk_ids = remap_experts(topk_ids, expert_map, gate_up.shape[0], "fused_moe")  # [T, A] local, -1: not here
    sorted_ids, expert_ids, _ = moe_align(topk_ids, gate_up.shape[0], block_m)
    h = moe_gemm(x, gate_up, sorted_ids, expert_ids, block_m, A)  # [T*A, 2I]
    if bias is not None:
        h = moe_bias_add(h, bias[0], topk_ids)
    h = activation(act)(h)  # [T*A, I]
    y = moe_gemm(h, down, sorted_ids, expert_ids, block_m, A, topk_weights, x_is_slots=True)  # [T*A, D]
    if bias is not None:
        y = moe_bias_add(y, bias[1], topk_ids, topk_weights)
    return moe_combine(y, A)  # [T, D]
