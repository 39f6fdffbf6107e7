"""topk_softmax_grouped: the DeepSeek-V2 router. ``logits [T, E] -> (weights [T, A] f32, ids [T, A] int32)``.

Softmax over experts in f32; group-limited: the E experts form ``n_group`` contiguous groups, a group's
score is its largest probability, and only the ``topk_group`` best groups are eligible (ties: the lower
group). The ``A`` largest eligible probabilities in descending order (ties: the lower expert id), times
``scale`` (routed_scaling_factor), never renormalised (as transformers runs DeepSeek-V2). With
``n_group = 1`` this is V2's "greedy" method.
"""
import numpy as np

from .topk_sigmoid import keep_groups


def topk_softmax_grouped(logits: np.ndarray, k: int, n_group: int, topk_group: int,
                         scale: float) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(logits, np.float32)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p = (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)  # [T, E]
    c = keep_groups(p, n_group, topk_group, lambda g: g.max(axis=-1))
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :k].astype(np.int32)  # [T, A]
    w = np.take_along_axis(p, ids, axis=-1)
    return (w * np.float32(scale)).astype(np.float32), ids
