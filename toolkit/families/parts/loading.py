"""Loaders the parts hand out for a checkpoint's tensors: shape-checked, expert by expert for stacked roles.

A loader is ``load() -> f32 array``; a stacked expert role's loader also takes ``load(e)`` for expert ``e`` alone,
so a quantizer can stream expert by expert. ``ck``: a ``toolkit.model.Checkpoint``.
"""
from __future__ import annotations

import numpy as np

from ...errors import ModelError


def expected_shape(name: str, a: np.ndarray, shape: tuple) -> np.ndarray:
    if tuple(a.shape) != tuple(shape):
        raise ModelError(f"tensor {name!r} has shape {list(a.shape)}, the config implies {list(shape)}")
    return a


def cat(get, names: list[str], shape: tuple) -> np.ndarray:
    """Load tensors of one ``shape`` each (checked before anything is joined) and stack their rows."""
    return np.concatenate([expected_shape(n, get(n), shape) for n in names])


def stacked(one, get, whole_name, n, shape):
    """loader(e) -> expert e as f32; loader() -> all experts [E, out, in] (``shape`` is one expert's)."""

    def load(e=None):
        if e is not None:
            a = np.asarray(one(e), dtype=np.float32)
            if not np.isfinite(a).all():
                raise ModelError(f"expert {e} of {whole_name or 'the experts'} holds NaN or inf")
            return a
        if get is not None:
            return get(whole_name)
        return np.stack([expected_shape(whole_name.replace("*", str(i)) + ("" if get is not None else ".weight"), one(i), shape)
                         for i in range(n)])

    return load


def where(ck, name: str) -> str:
    at = getattr(ck, "where", None)
    return at(name) if at is not None else str(ck.dir)


def shape_at(ck, name: str, a: np.ndarray, shape: tuple) -> np.ndarray:
    if tuple(a.shape) != tuple(shape):
        raise ModelError(f"{where(ck, name)}: tensor {name!r} has shape {list(a.shape)}, the config implies {list(shape)}")
    return a


def split_halves(b) -> tuple:
    """A bias ``[E, 2I]`` (gate columns, then up columns) as its two halves."""
    b = np.asarray(b, np.float32)
    return b[:, :b.shape[1] // 2], b[:, b.shape[1] // 2:]
