"""The launchers' layout contract: each ``run_<op>`` (``toolkit/gpu/<op>.py``) checks dtype, contiguity and shapes
before it launches, and a broken condition raises :class:`~toolkit.errors.BackendError` naming the op and it."""
from __future__ import annotations

import numpy as np

from ..errors import BackendError

NULL = np.uint64(0)  # a null pointer argument (8 bytes, like a device pointer)


def contract(op: str, ok: bool, condition: str) -> None:
    """Raise BackendError naming the op and the broken layout condition."""
    if not ok:
        raise BackendError(f"cuda {op}: layout contract broken: {condition}")


def check_array(op: str, name: str, a, dtype, ndim: int | None = None, shape: tuple | None = None) -> None:
    contract(op, a is not None and hasattr(a, "dtype") and hasattr(a, "shape"), f"{name} must be an array")
    contract(op, np.dtype(a.dtype) == np.dtype(dtype), f"{name}.dtype is {a.dtype}, expected {np.dtype(dtype)}")
    if ndim is not None:
        contract(op, a.ndim == ndim, f"{name} has {a.ndim} dims {tuple(a.shape)}, expected {ndim}")
    if shape is not None:
        want = tuple(shape)
        contract(op, tuple(a.shape) == want, f"{name}.shape is {tuple(a.shape)}, expected {want}")
    contract(op, bool(a.flags.c_contiguous), f"{name} must be C-contiguous")
