"""cuda positions: launcher of ``cuda_src/positions.cu``.

``lens int32 [B]`` (updated in place to ``lens + lengths``), ``lengths int32 [B]``, ``T`` ->
``positions int32 [B, T] = lens[b] + t`` (toolkit/ref/positions.py), in one launch.
"""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "positions"
KERNELS = ("positions_kernel",)
THREADS = 128


def check_positions(lens, lengths, T: int, out) -> None:
    check_array("positions", "lens", lens, np.int32, ndim=1)
    check_array("positions", "lengths", lengths, np.int32, shape=lens.shape)
    contract("positions", int(T) >= 0, f"T={T} must be >= 0")
    if out is not None:
        check_array("positions", "out", out, np.int32, shape=(lens.shape[0], int(T)))


def run_positions(rt, lens, lengths, T: int, out=None):
    check_positions(lens, lengths, T, out)
    B, T = lens.shape[0], int(T)
    out = rt.xp.empty((B, T), np.int32) if out is None else out  # [B, T]
    if B:
        rt.launch(SOURCE, "positions_kernel", (B,), (THREADS,), (lens, lengths, out, np.int32(T)))
    return out
