"""nll: negative log-likelihood of each target, for perplexity on the device.

``logits [N, V], targets [N] -> [N]``, ``logsumexp(logits[n]) - logits[n, targets[n]]`` (computed in f64,
returned as f32); a target outside ``[0, V)`` gives NaN.
"""
import numpy as np


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)  # [N, V]
    m = x.max(axis=1)  # [N]
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))  # [N]
    valid = (targets >= 0) & (targets < x.shape[1])
    picked = x[np.arange(len(x)), np.where(valid, targets, 0)]  # [N]
    return np.where(valid, lse - picked, np.nan).astype(np.float32)
