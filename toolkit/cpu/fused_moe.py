"""fused_moe (Numba): moe_align -> moe_gemm (GEMM1) -> silu_and_mul -> moe_gemm (GEMM2, routing weight in
the epilogue) -> moe_combine, each stage the Numba op of the same stem.

``x [T, D]``, ``topk_weights [T, A]``, ``topk_ids [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]``, ``down``
QTensor ``[E, D, I]`` -> ``[T, D]``. ``block_m`` only shapes the padding (the kernels work on compacted
segments): 16 at decode sizes (T*A/E <= 8), 64 otherwise. Per expert, moe_gemm picks the GEMV path for
<= 8 rows and the tiled BLAS path above (see toolkit/cpu/moe_gemm.py for the thread mapping).
One token with weight-only experts (the decode step) skips the alignment: each of its A experts is one
GEMV segment (``expert_rows``), then the A rows are summed.
``expert_map int32 [E_total]`` (spec: toolkit/ref/fused_moe.py): ``topk_ids`` global, the weights (and biases)
this call's ``E_local`` experts; slots mapped to -1 contribute nothing (the decode step drops them before its
GEMVs: none left -> zeros [1, D]; the multi-token path gives them no block and its bias adds skip them).
"""
import numpy as np

from ..layouts import remap_experts
from .clamped_swiglu import clamped_swiglu
from .moe_align import moe_align
from .moe_bias_add import moe_bias_add
from .moe_combine import moe_combine
from .moe_gemm import DECODE_MAX_ROWS, expert_rows, moe_gemm
from .silu_and_mul import silu_and_mul


def pick_block_m(T: int, A: int, E: int) -> int:
    return 16 if T * A <= DECODE_MAX_ROWS * E else 64


def activation(act):
    """The expert activation part: None -> silu_and_mul (SwiGLU); ("clamped_swiglu", alpha, limit) -> gpt-oss's."""
    if act is None:
        return silu_and_mul
    name, alpha, limit = act
    return lambda h: clamped_swiglu(h, alpha, limit)


def fused_moe(x, topk_weights, topk_ids, gate_up, down, bias=None, act=None, block_m: int | None = None, path=None,
              expert_map=None):
    """``bias``: (gate_up bias [E, 2I], down bias [E, D]) or None, added per expert on the slot rows;
    ``expert_map``: global -> local expert ids, -1 when not in this call (see the module docstring)."""
    T, A = topk_ids.shape
    E = gate_up.shape[0]
    local = topk_ids if expert_map is None else remap_experts(topk_ids, expert_map, E, "fused_moe")  # [T, A]
    if T == 1 and path is None and gate_up.fmt.act_quant is None and down.fmt.act_quant is None:
        w = topk_weights
        if expert_map is not None:
            kept = np.nonzero(local[0] >= 0)[0]  # [A'] the slots of this call's experts
            if kept.size == 0:
                return np.zeros((1, down.shape[1]), np.float32)  # [1, D]
            local, w = local[:, kept], np.asarray(topk_weights)[:, kept]  # [1, A']
        return _one_token(x, w, local, gate_up, down, bias, activation(act))
    bm = block_m or pick_block_m(T, A, E)
    sorted_ids, expert_ids, _ = moe_align(topk_ids, E, bm, expert_map)
    h = moe_gemm(x, gate_up, sorted_ids, expert_ids, bm, A, path=path)  # [T*A, 2I]
    if bias is not None:
        moe_bias_add(h, bias[0], local)
    h = activation(act)(h)  # [T*A, I]
    y = moe_gemm(h, down, sorted_ids, expert_ids, bm, A, topk_weights, x_is_slots=True, path=path)  # [T*A, D]
    if bias is not None:
        moe_bias_add(y, bias[1], local, topk_weights)
    return moe_combine(y, A)  # [T, D]


def _one_token(x, topk_weights, topk_ids, gate_up, down, bias, act):
    """Decode: one token, its A distinct experts as one GEMV segment each (no alignment, no gather)."""
    ids = topk_ids[0]
    A = ids.shape[0]
    w = np.ascontiguousarray(topk_weights, np.float32)
    h = expert_rows(np.broadcast_to(x, (A, x.shape[1])), gate_up, ids, np.ones(A, np.float32))  # [A, 2I]
    if bias is not None:
        moe_bias_add(h, bias[0], topk_ids)
    y = expert_rows(act(h), down, ids, w.reshape(-1))  # [A, D]
    if bias is not None:
        moe_bias_add(y, bias[1], topk_ids, w)
    return y.sum(axis=0, keepdims=True, dtype=np.float32)  # [1, D]
