"""Index layouts every backend shares (host-side arithmetic and checks, not ops): the expert map of expert
parallelism (vLLM's ``expert_map``) and the order of a checkpoint's interleaved rope pairs.

The NumPy reference (``toolkit/ref``), the Numba backend and whoever builds a map all use these; a backend's
kernels never import the reference.
"""
import numpy as np


def check_expert_map(expert_map, num_local: int, op: str = "moe_align") -> np.ndarray:
    """The map as int32 ``[E_total]`` after checking it: non-empty 1-D integers in ``[-1, num_local)``
    (the GPU backends cannot read a device map back: check it here, on the host, when it is built)."""
    m = np.asarray(expert_map)
    if m.ndim != 1 or m.size == 0 or m.dtype.kind not in "iu":
        raise ValueError(f"{op}: expert_map must be a non-empty 1-D integer array [E_total], got {m.dtype} {m.shape}")
    if m.min() < -1 or m.max() >= num_local:
        raise ValueError(f"{op}: expert_map values must lie in [-1, {num_local}) (-1: not in this call; "
                         f"{num_local} local experts), got [{m.min()}, {m.max()}]")
    return m.astype(np.int32)


def remap_experts(ids, expert_map, num_local: int, op: str = "moe_align") -> np.ndarray:
    """``ids [T, A]`` global expert ids -> ``[T, A] int32`` local ids ``expert_map[ids]`` (-1: not in this call),
    after checking the map (:func:`check_expert_map`) and that ``ids`` lie in ``[0, len(expert_map))``."""
    m = check_expert_map(expert_map, num_local, op)  # [E_total]
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= m.size):
        raise ValueError(f"{op}: expert ids must lie in [0, len(expert_map)) = [0, {m.size}), "
                         f"got [{ids.min()}, {ids.max()}]")
    return m[ids]  # [T, A]


def deinterleave(dr: int) -> np.ndarray:
    """Interleaved rope pairs -> rotate-half order (even dims, then odd dims): the same rotation of q and k."""
    return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
