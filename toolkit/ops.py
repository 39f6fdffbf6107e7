"""Op dispatch: ``get_op(name, backend)`` returns the callable for one op on one backend.

Layers call this once, when they are built, and keep the callable; nothing switches backends later.
Every op has the same stem in ``toolkit/ref`` (NumPy reference), ``toolkit/cpu`` (Numba) and, for the
GPU, ``toolkit/gpu`` and ``cuda_src/<op>.cu``.
"""
from __future__ import annotations

import importlib

from .backend import resolve_backend
from .errors import BackendError

OPS = ("rms_norm", "rope", "attention", "topk_softmax", "silu_and_mul", "moe_experts",
       "moe_align", "moe_gemm", "moe_combine", "fused_moe", "qlinear", "kv_store", "kv_attention")
_PACKAGES = {"numpy": "toolkit.ref", "numba": "toolkit.cpu", "cuda": "toolkit.gpu"}


def get_op(name: str, backend: str):
    if name not in OPS:
        raise BackendError(f"unknown op {name!r}; ops: {', '.join(OPS)}")
    b = resolve_backend(backend)
    try:
        module = importlib.import_module(f"{_PACKAGES[b]}.{name}")
    except ModuleNotFoundError as e:
        raise BackendError(f"op {name!r} has no {b!r} implementation") from e
    return getattr(module, name)
