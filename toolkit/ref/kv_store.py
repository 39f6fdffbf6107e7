"""kv_store: quantize-on-write of new K or V rows into a preallocated cache store (the spec).

``store [B, Hkv, S, row]`` (f32 rows of hd, or uint8 rows of hd/32 GGML blocks), ``x [B, T, Hkv, hd]`` new
rows, ``positions [B, T]``: row ``x[b, t, h]`` is encoded with the format's NumPy codec and written to
``store[b, h, positions[b, t]]``. Nothing is reallocated.
"""
import numpy as np

from .kv_attention import k_fmt_key


def kv_store(store: np.ndarray, fmt, x: np.ndarray, positions: np.ndarray) -> None:
    rows = fmt.codec("numpy").quantize(np.ascontiguousarray(x, np.float32), fmt)[k_fmt_key(fmt)]  # [B, T, Hkv, row]
    b = np.arange(x.shape[0])[:, None]
    store[b, :, positions] = rows
