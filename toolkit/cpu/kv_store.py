"""kv_store (Numba): quantize the new K or V rows straight into the preallocated cache store.

Parallel over (sequence, new token); each row (one KV head of one token) is encoded in place.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import kernel

from .kv_codecs import ROW_CODES, row_store


@kernel()
def _kv_store(store, code, x, positions):  # store [B, Hkv, S, row], x [B, T, Hkv, hd], positions [B, T]
    B, T, Hkv, _ = x.shape
    for bt in prange(B * T):
        b, t = bt // T, bt % T
        p = positions[b, t]
        for h in range(Hkv):
            row_store(code, x[b, t, h], store[b, h, p])


def kv_store(store: np.ndarray, fmt, x: np.ndarray, positions: np.ndarray) -> None:
    _kv_store(x.size * 4, store, ROW_CODES[fmt.name], np.ascontiguousarray(x, dtype=np.float32),
              np.ascontiguousarray(positions, dtype=np.int64))
