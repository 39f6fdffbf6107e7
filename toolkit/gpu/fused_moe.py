"""cuda fused_moe: the routed experts of one MoE layer as the named stages of toolkit/ref/fused_moe.py,
each a kernel of cuda_src/: moe_align -> moe_gemm (GEMM1, [T*A, 2I]) -> silu_and_mul ([T*A, I]) ->
moe_gemm (GEMM2, routing weight in the epilogue, [T*A, D]) -> moe_combine ([T, D]).

``x f32 [T, D]``, ``topk_weights f32 [T, A]``, ``topk_ids int32 [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]``,
``down`` QTensor ``[E, D, I]`` -> ``[T, D]``. No kernels of its own (``KERNELS`` is empty).
On tensor cores (``moe_gemm.default_kind`` is 'mma') a plain SwiGLU layer runs silu_and_mul in GEMM1's epilogue
(one kernel, no [T*A, 2I] intermediate). moe_align's layout stays in its upper-bound buffers (blocks past the real ones have expert -1 and the GEMMs skip
them), so the whole layer is planned from shapes and never synchronises with the host.
``expert_map`` (int32 ``[E_total]`` on the device, or None; spec: toolkit/ref/fused_moe.py): moe_align_remap turns
``topk_ids`` into local ids first (-1: not in this call); those slots get no block, the bias adds skip them and the
GEMMs' outputs are zero-filled on the tensor-core path (whose kernel writes only routed rows), so their rows
combine as zeros. ``bias`` is then local (``[E_local, ...]``).
"""
from __future__ import annotations



from .clamped_swiglu import run_clamped_swiglu
from .moe_align import run_moe_align, run_moe_align_remap
from .moe_bias_add import run_moe_bias_add
from .moe_combine import run_moe_combine
from .moe_gemm import default_kind, run_moe_gemm
from .silu_and_mul import run_silu_and_mul

KERNELS = ()


def run_fused_moe(rt, x, topk_weights, topk_ids, gate_up, down, block_m: int = 16, bias=None, act=None,
                  expert_map=None):
    """``bias``: (gate_up bias [E, 2I], down bias [E, D]) or None; ``act``: None (SwiGLU) or
    ("clamped_swiglu", alpha, limit) (gpt-oss); ``expert_map``: int32 [E_total] device array or None."""
    A = topk_ids.shape[1]
    E = gate_up.shape[0]
    zero = {}  # tensor-core GEMM options: none without a map (today's launches exactly)
    if expert_map is not None:
        topk_ids = run_moe_align_remap(rt, topk_ids, expert_map, E)  # [T, A] local ids, -1: not in this call
        zero = {"zero_fill": True}  # the -1 slots' rows, which no block writes
    sorted_ids, expert_ids, _ = run_moe_align(rt, topk_ids, E, block_m)  # upper-bound layout
    if bias is None and act is None and default_kind(rt, gate_up.fmt, False) == "mma":
        # tensor cores: silu_and_mul fused into GEMM1's epilogue
        h = run_moe_gemm(rt, x, gate_up, sorted_ids, expert_ids, block_m, A, kind="mma", silu=True, **zero)  # [T*A, I]
    else:
        h = run_moe_gemm(rt, x, gate_up, sorted_ids, expert_ids, block_m, A, **zero)  # [T*A, 2I]
        if bias is not None:
            run_moe_bias_add(rt, h, bias[0], topk_ids)
        h = run_silu_and_mul(rt, h) if act is None else run_clamped_swiglu(rt, h, *act[1:])  # [T*A, I]
    y = run_moe_gemm(rt, h, down, sorted_ids, expert_ids, block_m, A, topk_weights, x_is_slots=True, **zero)  # [T*A, D]
    if bias is not None:
        run_moe_bias_add(rt, y, bias[1], topk_ids, topk_weights)
    return run_moe_combine(rt, y, A)  # [T, D]

