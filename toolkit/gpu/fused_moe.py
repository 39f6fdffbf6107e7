"""cuda fused_moe: the routed experts of one MoE layer as the named stages of toolkit/ref/fused_moe.py,
each a kernel of cuda_src/: moe_align -> moe_gemm (GEMM1, [T*A, 2I]) -> silu_and_mul ([T*A, I]) ->
moe_gemm (GEMM2, routing weight in the epilogue, [T*A, D]) -> moe_combine ([T, D]).

``x f32 [T, D]``, ``topk_weights f32 [T, A]``, ``topk_ids int32 [T, A]``, ``gate_up`` QTensor ``[E, 2I, D]``,
``down`` QTensor ``[E, D, I]`` -> ``[T, D]``. No kernels of its own (``KERNELS`` is empty).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .launch import gpu, to_device
from .moe_align import run_moe_align
from .moe_combine import run_moe_combine
from .moe_gemm import run_moe_gemm
from .silu_and_mul import run_silu_and_mul

KERNELS = ()


def run_fused_moe(rt, x, topk_weights, topk_ids, gate_up, down, block_m: int = 16):
    A = topk_ids.shape[1]
    sorted_ids, expert_ids, _ = run_moe_align(rt, topk_ids, gate_up.shape[0], block_m)
    h = run_moe_gemm(rt, x, gate_up, sorted_ids, expert_ids, block_m, A)  # [T*A, 2I]
    h = run_silu_and_mul(rt, h)  # [T*A, I]
    y = run_moe_gemm(rt, h, down, sorted_ids, expert_ids, block_m, A, topk_weights, x_is_slots=True)  # [T*A, D]
    return run_moe_combine(rt, y, A)  # [T, D]


def fused_moe(x, topk_weights, topk_ids, gate_up, down, block_m: int = 16):
    rt = gpu()

    def dev(w):
        return dataclasses.replace(w, arrays={k: to_device(rt, a) for k, a in w.arrays.items()})

    out = run_fused_moe(rt, to_device(rt, np.asarray(x, np.float32)), to_device(rt, np.asarray(topk_weights, np.float32)),
                        to_device(rt, np.asarray(topk_ids, np.int32)), dev(gate_up), dev(down), block_m)
    return rt.host(out)
