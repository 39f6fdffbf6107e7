"""kv_store (Numba): quantize the new K or V rows straight into the preallocated cache store.

Parallel over (sequence, new token); each row (one KV head of one token) is encoded in place.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ._jit import Kernel, twin
from .kv_codecs import ROW_CODECS


def _kv_store(store, x, positions):  # store [B, Hkv, S, row], x [B, T, Hkv, hd], positions [B, T]
    B, T, Hkv, _ = x.shape
    for bt in prange(B * T):
        b, t = bt // T, bt % T
        p = positions[b, t]
        for h in range(Hkv):
            row_store(x[b, t, h], store[b, h, p])  # noqa: F821 (bound per cache format)


@functools.cache
def kernel_for(name: str) -> Kernel:
    """The store kernel of one cache format (``f32``, ``q8_0``, ``q4_0``): compiled and cached on its own."""
    return Kernel(twin(_kv_store, f"__{name}", row_store=ROW_CODECS[name][0]))


def kv_store(store: np.ndarray, fmt, x: np.ndarray, positions: np.ndarray) -> None:
    kernel_for(fmt.name)(x.size * 4, store, np.ascontiguousarray(x, dtype=np.float32),
                         np.ascontiguousarray(positions, dtype=np.int64))
