"""Where each runtime weight lives in a bundle: layer keys (module paths, as mistral.rs names them), the
residual tensor names, and the exact split / re-join of our fused ``gate_up`` (gate rows, then up rows).

``layer_keys(role, name)`` takes the ``(role, checkpoint name)`` pair that ``toolkit.model.weights``
yields: ``moe.gate_up`` of ``model.layers.3.block_sparse_moe.experts.*.w1+w3`` becomes the stacked
``[E, I, D]`` layers ``model.layers.3.block_sparse_moe.experts.gate_proj`` and ``...experts.up_proj``.
"""
from __future__ import annotations

import numpy as np

from ..formats import QTensor
from ..formats.base import JoinedArrays
from .spec import EXPERTS_DOWN, SPLIT_ROLES, SPLIT_SUFFIXES, UQFFError


def layer_keys(role: str, name: str) -> tuple[list[str], list[str]]:
    """(layer keys, residual tensor names) of one runtime weight; two of each for split roles."""
    if role in ("moe.gate_up", "moe.down"):
        base = name.split(".experts")[0] + ".experts"
        keys = [base + s for s in SPLIT_SUFFIXES] if role == "moe.gate_up" else [base + EXPERTS_DOWN]
    elif role in SPLIT_ROLES:
        base = name.rsplit(".", 1)[0]  # "model.layers.0.mlp.gate_proj+up_proj" -> "model.layers.0.mlp"
        keys = [base + s for s in SPLIT_SUFFIXES]
    elif name.endswith(".weight"):
        keys = [name[: -len(".weight")]]
    else:  # biases keep their own name
        return [name], [name]
    return keys, [k + ".weight" for k in keys]


def expert_keys(keys: list[str], e: int) -> list[str]:
    """The layer keys of expert ``e`` alone, for experts stored at mixed widths (one layer per expert and
    projection): ``...experts.gate_proj`` -> ``...experts.5.gate_proj``."""
    return [k.replace(".experts.", f".experts.{e}.", 1) for k in keys]


def split_rows(x, parts: int) -> list:
    """Split the output rows (axis -2 of the logical shape) of a dense array or a QTensor into ``parts``."""
    if parts == 1:
        return [x]
    if isinstance(x, QTensor):
        axis, n = len(x.shape) - 2, x.shape[-2]
        if n % parts:
            raise UQFFError(f"cannot split {n} rows of a {x.fmt.spec} tensor into {parts} equal parts")
        pieces = {k: np.split(a, parts, axis=axis) for k, a in x.arrays.items()}
        shape = x.shape[:-2] + (n // parts, x.shape[-1])
        return [QTensor(x.fmt, shape, {k: np.ascontiguousarray(v[i]) for k, v in pieces.items()}) for i in range(parts)]
    return list(np.split(np.asarray(x), parts, axis=-2))


def join_rows(parts: list):
    """The inverse of :func:`split_rows` (exact: the stored arrays concatenated; for QTensors, when read:
    :class:`~toolkit.formats.base.JoinedArrays` keeps the parts, so a mapped file's pages are not copied)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, QTensor):
        axis = len(first.shape) - 2
        if any(not isinstance(p, QTensor) or p.fmt != first.fmt or p.shape != first.shape for p in parts):
            raise UQFFError("the halves of a split projection differ in format or shape: "
                            + ", ".join(f"{p.fmt.spec if isinstance(p, QTensor) else 'dense'}{list(p.shape)}" for p in parts))
        shape = first.shape[:-2] + (first.shape[-2] * len(parts), first.shape[-1])
        return QTensor(first.fmt, shape, JoinedArrays(parts, axis))
    return np.concatenate(parts, axis=-2)
