"""cuda moe_align: launcher of ``cuda_src/moe_align.cu`` (vLLM moe_align_block_size).

``ids int32 [T, A], E, block_m -> (sorted_ids int32 [P_cap], expert_ids int32 [P_cap / block_m], total int32 [1])``
in buffers sized by the upper bound ``P_cap`` (:func:`align_capacity`): the reference's layout
(toolkit/ref/moe_align.py) is the prefix ``sorted_ids[:P], expert_ids[:P / block_m]`` with ``P = total[0]``;
every slot past it holds the sentinel ``T*A`` and every block past it the expert ``-1`` (moe_gemm skips those).
Three deterministic kernels (count, padded offsets, in-order scatter); the plan depends on shapes only and
nothing is read back to the host (``total`` stays on the device).
"""
from __future__ import annotations

import numpy as np

from .launch import check_array, contract

SOURCE = "moe_align"
KERNELS = ("moe_align_count", "moe_align_offsets", "moe_align_scatter")
THREADS = 256


def check_moe_align(ids, num_experts: int, block_m: int) -> None:
    check_array("moe_align", "ids", ids, np.int32, ndim=2)
    contract("moe_align", int(num_experts) >= 1, f"num_experts={num_experts} must be >= 1")
    contract("moe_align", int(block_m) >= 1, f"block_m={block_m} must be >= 1")


def align_capacity(n_slots: int, num_experts: int, block_m: int) -> int:
    """M-blocks of the upper-bound layout: ``P_max = T*A + E*(block_m - 1)`` in whole blocks (at least one, so
    no buffer is empty); ``P_cap = align_capacity(...) * block_m``."""
    return max(1, -(-(int(n_slots) + int(num_experts) * (int(block_m) - 1)) // int(block_m)))


def run_moe_align(rt, ids, num_experts: int, block_m: int):
    check_moe_align(ids, num_experts, block_m)
    xp, n, E, bm = rt.xp, int(ids.size), int(num_experts), int(block_m)
    max_blocks = align_capacity(n, E, bm)
    counts = xp.empty(E, np.int32)  # [E]
    offsets = xp.empty(E + 1, np.int32)  # [E+1]
    sorted_ids = xp.empty(max_blocks * bm, np.int32)  # [P_cap]
    expert_ids = xp.empty(max_blocks, np.int32)  # [P_cap / block_m]
    total = xp.empty(1, np.int32)  # [1] = P
    rt.launch(SOURCE, "moe_align_count", (E,), (THREADS,), (ids, np.int32(n), counts))
    rt.launch(SOURCE, "moe_align_offsets", (1,), (32,),
              (counts, np.int32(E), np.int32(bm), np.int32(max_blocks), offsets, expert_ids, total))
    rt.launch(SOURCE, "moe_align_scatter", (E,), (THREADS,),
              (ids, np.int32(n), offsets, np.int32(max_blocks * bm), sorted_ids))
    return sorted_ids, expert_ids, total

