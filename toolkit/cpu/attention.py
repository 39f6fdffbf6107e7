"""attention (Numba): dense GQA causal attention over f32 K/V ``[B, Hkv, S, hd]``.

An f32 cache is one of the cache formats, so this is the ``kv_attention`` kernel with f32 rows
(one kernel, not two copies); see toolkit/cpu/kv_attention.py for the thread mapping.
"""
import numpy as np

from ..formats import get_format
from .kv_attention import kv_attention

_F32 = get_format("f32")


def attention(q, k, v, positions, scale: float, window: int = 0, sinks=None) -> np.ndarray:
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    return kv_attention(q, k, v, _F32, _F32, positions, scale, window, sinks)
