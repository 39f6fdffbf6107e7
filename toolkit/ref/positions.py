"""positions: the absolute positions of a step's tokens, and the cache lengths after it.

``lens [B]`` tokens each sequence already holds, ``lengths [B]`` valid new tokens of this step (right-padded
to ``T``) -> ``positions [B, T] = lens[b] + t`` (padding slots too) and ``lens + lengths`` (int32).
"""
import numpy as np


def positions(lens: np.ndarray, lengths: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    pos = (lens[:, None] + np.arange(T)[None, :]).astype(np.int32)  # [B, T]
    return pos, (lens + lengths).astype(np.int32)  # [B]
