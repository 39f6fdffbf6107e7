"""moe_align (Numba): counting sort of the flat slots by expert, padded to whole M-blocks; single thread
(T*A is small and a prange costs more than the work). Same outputs as ``toolkit/ref/moe_align.py``:
``ids [T, A]`` -> ``sorted_ids int32 [P]``, ``expert_ids int32 [P // block_m]``, ``P``; ``expert_map``: remap
to local ids first, slots mapped to -1 get no block (they are dropped before ``_align``, which indexes by id).
"""
import numpy as np
from numba import njit

from ..layouts import remap_experts


@njit(cache=True)
def _align(flat, num_experts, block_m):  # flat [T*A] -> sorted [P], expert_ids [P // block_m]
    # np.empty and loops only: each np.zeros / np.full / .copy() specialization costs ~0.1-0.2 s of a cold compile
    counts = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        counts[e] = 0
    for i in range(flat.shape[0]):
        counts[flat[i]] += 1
    start = np.empty(num_experts + 1, np.int64)  # padded run offsets
    start[0] = 0
    for e in range(num_experts):
        start[e + 1] = start[e] + (counts[e] + block_m - 1) // block_m * block_m
    P = start[num_experts]
    sorted_ids = np.empty(P, np.int32)
    for i in range(P):
        sorted_ids[i] = flat.shape[0]
    expert_ids = np.empty(P // block_m, np.int32)
    for e in range(num_experts):
        for b in range(start[e] // block_m, start[e + 1] // block_m):
            expert_ids[b] = e
    for e in range(num_experts):  # counts becomes each run's fill position
        counts[e] = start[e]
    for i in range(flat.shape[0]):
        e = flat[i]
        sorted_ids[counts[e]] = i
        counts[e] += 1
    return sorted_ids, expert_ids


def moe_align(ids, num_experts: int, block_m: int, expert_map=None):
    flat = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)  # [T*A]
    if expert_map is not None:
        local = remap_experts(flat, expert_map, num_experts)  # [T*A], -1: not in this call
        kept = np.nonzero(local >= 0)[0].astype(np.int32)  # [R] the slots of this call's experts
        sorted_kept, expert_ids = _align(np.ascontiguousarray(local[kept]), num_experts, block_m)
        # positions in ``kept`` back to slot ids; _align's sentinel R becomes T*A
        sorted_ids = np.append(kept, np.int32(flat.size))[sorted_kept]  # [P]
        return sorted_ids, expert_ids, int(sorted_ids.size)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"moe_align: expert ids must lie in [0, {num_experts}), got [{flat.min()}, {flat.max()}]")
    sorted_ids, expert_ids = _align(flat, num_experts, block_m)
    return sorted_ids, expert_ids, int(sorted_ids.size)
