"""topk_softmax: the router. ``logits [T, E] -> (weights [T, A] f32, ids [T, A] int32)``.

Softmax over experts in f32, the ``A`` largest probabilities in descending order (ties: the lower expert
id wins), optionally renormalised to sum to 1 over the chosen experts (Mixtral: yes; Qwen2-MoE: config).
"""
import numpy as np


def topk_softmax(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    x = logits.astype(np.float32)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)  # [T, E]
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k].astype(np.int32)  # stable: lower id first on ties
    w = np.take_along_axis(p, ids, axis=-1)  # [T, A]
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w.astype(np.float32), ids
