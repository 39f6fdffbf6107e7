"""mark_seen: the repetition penalty's seen-token mask at prefill (the state ``sample`` reads and updates)."""
import numpy as np


def mark_seen(ids: np.ndarray, lengths: np.ndarray, seen: np.ndarray) -> None:
    """Prefill: ``ids [B, T]``, ``lengths [B]``, ``seen [B, V]``: ``seen[b, ids[b, t]] = 1`` for ``t < lengths[b]``
    (ids outside ``[0, V)`` are skipped)."""
    B, V = seen.shape
    for b in range(B):
        row = ids[b, : lengths[b]]
        seen[b, row[(row >= 0) & (row < V)]] = 1
