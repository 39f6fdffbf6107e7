"""cuda moe_align: launcher of ``cuda_src/moe_align.cu`` (vLLM moe_align_block_size).

``ids int32 [T, A], E, block_m -> (sorted_ids int32 [P], expert_ids int32 [P / block_m], P)``; three
deterministic kernels (count, padded offsets, in-order scatter); one device->host read of ``P``.
"""
from __future__ import annotations

import numpy as np

from .launch import check_array, contract, gpu, to_device

SOURCE = "moe_align"
KERNELS = ("moe_align_count", "moe_align_offsets", "moe_align_scatter")
THREADS = 256


def check_moe_align(ids, num_experts: int, block_m: int) -> None:
    check_array("moe_align", "ids", ids, np.int32, ndim=2)
    contract("moe_align", int(num_experts) >= 1, f"num_experts={num_experts} must be >= 1")
    contract("moe_align", int(block_m) >= 1, f"block_m={block_m} must be >= 1")


def run_moe_align(rt, ids, num_experts: int, block_m: int):
    check_moe_align(ids, num_experts, block_m)
    xp, n, E = rt.xp, int(ids.size), int(num_experts)
    p_max = n + E * (block_m - 1)
    counts = xp.zeros(E, np.int32)  # [E]
    offsets = xp.zeros(E + 1, np.int32)  # [E+1]
    sorted_ids = xp.zeros(max(1, p_max), np.int32)  # [P_max]
    expert_ids = xp.zeros(max(1, -(-p_max // block_m)), np.int32)  # [P_max / block_m]
    total = xp.zeros(1, np.int32)
    rt.launch(SOURCE, "moe_align_count", (E,), (THREADS,), (ids, np.int32(n), counts))
    rt.launch(SOURCE, "moe_align_offsets", (1,), (32,),
              (counts, np.int32(E), np.int32(block_m), offsets, expert_ids, total))
    rt.launch(SOURCE, "moe_align_scatter", (E,), (THREADS,), (ids, np.int32(n), offsets, sorted_ids))
    P = int(rt.host(total)[0])
    return sorted_ids[:P], expert_ids[: P // block_m], P


def moe_align(ids, num_experts: int, block_m: int):
    rt = gpu()
    s, e, P = run_moe_align(rt, to_device(rt, ids), num_experts, block_m)
    return rt.host(s), rt.host(e), P
