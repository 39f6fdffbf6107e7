"""cuda moe_align: launcher of ``cuda_src/moe_align.cu`` (vLLM moe_align_block_size).

``ids int32 [T, A], E, block_m -> (sorted_ids int32 [P_cap], expert_ids int32 [P_cap / block_m], total int32 [1])``
in buffers sized by the upper bound ``P_cap`` (:func:`align_capacity`): the reference's layout
(toolkit/ref/moe_align.py) is the prefix ``sorted_ids[:P], expert_ids[:P / block_m]`` with ``P = total[0]``;
every slot past it holds the sentinel ``T*A`` and every block past it the expert ``-1`` (moe_gemm skips those).
Three deterministic kernels (count, padded offsets, in-order scatter); the plan depends on shapes only and
nothing is read back to the host (``total`` stays on the device).
``expert_map`` (int32 ``[E_total]`` on the device; fused_moe's): the ids are first remapped to local ones by a
fourth kernel (:func:`run_moe_align_remap`), slots mapped to -1 get no block. The map's values cannot be checked
here without reading it back: the kernel turns out-of-range ids and values into -1 (nothing out of bounds is
read); whoever builds a map checks it on the host (``toolkit.layouts.check_expert_map``).
"""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "moe_align"
KERNELS = ("moe_align_count", "moe_align_offsets", "moe_align_scatter", "moe_align_remap")
THREADS = 256


def check_moe_align(ids, num_experts: int, block_m: int) -> None:
    check_array("moe_align", "ids", ids, np.int32, ndim=2)
    contract("moe_align", int(num_experts) >= 1, f"num_experts={num_experts} must be >= 1")
    contract("moe_align", int(block_m) >= 1, f"block_m={block_m} must be >= 1")


def check_expert_map(expert_map) -> None:
    check_array("moe_align", "expert_map", expert_map, np.int32, ndim=1)
    contract("moe_align", expert_map.shape[0] >= 1, "expert_map [E_total] must not be empty")


def run_moe_align_remap(rt, ids, expert_map, num_experts: int):
    """``ids int32 [T, A]`` global expert ids -> ``int32 [T, A]`` local ids ``expert_map[ids]`` (-1: not in this
    call) of ``num_experts`` local experts, on the device."""
    check_moe_align(ids, num_experts, 1)
    check_expert_map(expert_map)
    n = int(ids.size)
    local = rt.xp.empty(ids.shape, np.int32)  # [T, A]
    if n:
        rt.launch(SOURCE, "moe_align_remap", (-(-n // THREADS),), (THREADS,),
                  (ids, np.int32(n), expert_map, np.int32(expert_map.shape[0]), np.int32(num_experts), local))
    return local


def align_capacity(n_slots: int, num_experts: int, block_m: int) -> int:
    """M-blocks of the upper-bound layout: ``P_max = T*A + E*(block_m - 1)`` in whole blocks (at least one, so
    no buffer is empty); ``P_cap = align_capacity(...) * block_m``."""
    return max(1, -(-(int(n_slots) + int(num_experts) * (int(block_m) - 1)) // int(block_m)))


def run_moe_align(rt, ids, num_experts: int, block_m: int, expert_map=None):
    check_moe_align(ids, num_experts, block_m)
    if expert_map is not None:
        ids = run_moe_align_remap(rt, ids, expert_map, num_experts)  # [T, A] local, -1: no block
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

