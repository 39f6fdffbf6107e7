"""topk_sigmoid: the DeepSeek-V3 router (also Kimi / Moonlight, GLM-4.5).
``logits [T, E], bias [E] or None -> (weights [T, A] f32, ids [T, A] int32)``.

Scores ``s = sigmoid(logits)`` in f32; the choice ranks ``c = s + bias`` (the bias steers selection only).
Group-limited: the E experts form ``n_group`` contiguous groups, a group's score is the sum of its two
largest ``c``, and only the ``topk_group`` best groups are eligible (ties: the lower group wins). The ``A``
largest eligible ``c`` in descending order (ties: the lower expert id); their weights are ``s`` (without
the bias), renormalised to sum to 1 when asked (``/ (sum + 1e-20)``), times ``scale`` (routed_scaling_factor).
"""
import numpy as np


def keep_groups(c: np.ndarray, n_group: int, topk_group: int, group_score) -> np.ndarray:
    """``c [T, E]`` with the experts outside each row's ``topk_group`` best groups set to -inf."""
    if n_group <= 1 or topk_group >= n_group:
        return c
    T, E = c.shape
    g = c.reshape(T, n_group, E // n_group)  # [T, G, E/G]
    best = np.argsort(-group_score(g), axis=-1, kind="stable")[:, :topk_group]  # [T, topk_group]
    keep = np.zeros((T, n_group), bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return np.where(np.repeat(keep, E // n_group, axis=-1), c, np.float32(-np.inf)).astype(np.float32)


def top2_sum(g: np.ndarray) -> np.ndarray:
    """``[T, G, n] -> [T, G]``: the sum of each group's two largest scores (the one score of a group of one)."""
    top = np.sort(g, axis=-1)[..., -2:]
    return top[..., -1] + top[..., 0] if top.shape[-1] == 2 else top[..., -1]


def topk_sigmoid(logits: np.ndarray, bias, k: int, n_group: int, topk_group: int, renormalize: bool,
                 scale: float) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(logits, np.float32)
    s = (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)  # [T, E]
    c = s + np.asarray(bias, np.float32) if bias is not None else s
    c = keep_groups(c, n_group, topk_group, top2_sum)
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :k].astype(np.int32)  # [T, A]; stable: lower id on ties
    w = np.take_along_axis(s, ids, axis=-1)  # [T, A]
    if renormalize:
        w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return (w * np.float32(scale)).astype(np.float32), ids
