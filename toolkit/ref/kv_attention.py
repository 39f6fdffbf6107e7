"""kv_attention: attention of new queries over a KV cache stored in any cache format (the spec).

``q [B, T, H, hd]``; ``k_store, v_store``: the cache arrays of one layer, ``[B, Hkv, S, hd]`` f32 or
``[B, Hkv, S, hd/32 * block_bytes]`` uint8 GGML blocks (q8_0 / q4_0) along the head dim; ``k_fmt, v_fmt``
their formats; ``positions [B, T]``; ``sinks [H]`` or None (toolkit/ref/attention.py) -> ``[B, T, H, hd]``. The reference decodes the visible cache with the
format's NumPy codec, then runs the dense reference attention.
"""
import numpy as np

from .attention import attention


def kv_attention(q, k_store, v_store, k_fmt, v_fmt, positions, scale: float, window: int = 0,
                 sinks=None) -> np.ndarray:
    B, Hkv, S = k_store.shape[:3]
    hd = q.shape[-1]
    n = int(np.max(positions)) + 1  # cache rows any query can see
    k = k_fmt.codec("numpy").dequantize({k_fmt_key(k_fmt): k_store[:, :, :n]}, k_fmt, (B, Hkv, n, hd))
    v = v_fmt.codec("numpy").dequantize({k_fmt_key(v_fmt): v_store[:, :, :n]}, v_fmt, (B, Hkv, n, hd))
    return attention(q, k, v, positions, scale, window, sinks)


def k_fmt_key(fmt) -> str:
    """The single array name of a cache format's layout (``weight`` for f32, ``blocks`` for GGML)."""
    (name,) = fmt.arrays((1, 32)).keys()
    return name
