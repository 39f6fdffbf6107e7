"""kv_rotate (Numba): rows through the rotated key cache's Hadamard matrix at one token, ``x [R, hd]`` ->
``out [R, hd] = x @ H.T`` (``H = hadamard(hd)``, symmetric), one ``gemv_f32`` per row.

The KV cache (``toolkit/model/kv_cache.py``, ``rotate_k``) rotates keys before they are stored and queries
before attention. At one token per sequence on the numba backend it calls this, and so does the compiled
decode step (``toolkit/cpu/decode_layer.py``) inside its kernel: the two decode paths rotate with the same
bits. Prefill keeps BLAS (``Linear``). A dense product, not a fast Walsh-Hadamard transform: at a head dim of
32-128 it is ``hd`` multiply-adds per value, a few microseconds a layer.
"""
from numba import njit

from .gemv_f32 import gemv_f32


@njit(cache=True)
def kv_rotate(x, h, out):  # x [R, hd], h [hd, hd] -> out [R, hd]
    for r in range(x.shape[0]):
        gemv_f32(h, x[r], out[r])
