"""The KV cache: preallocated per layer, ``k, v [B, Hkv, S, hd]``, with ``lens [B]`` tokens held per sequence.

Writing never reallocates: a step writes its new K/V rows at their absolute positions.
"""
from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int):
        self.max_len = int(max_len)
        shape = (batch, n_kv_heads, self.max_len, head_dim)  # [B, Hkv, S, hd]
        self.k = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.lens = np.zeros(batch, np.int64)  # [B]

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """k, v [B, T, Hkv, hd] at positions [B, T]."""
        b = np.arange(k.shape[0])[:, None]  # [B, 1]
        self.k[layer][b, :, positions] = k  # advanced indices first: [B, T, Hkv, hd]
        self.v[layer][b, :, positions] = v

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k[layer], self.v[layer]

    @property
    def bytes_per_token(self) -> int:
        _, hkv, _, hd = self.k[0].shape
        return 2 * len(self.k) * hkv * hd * 4

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)
