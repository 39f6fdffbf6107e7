"""Op dispatch: ``get_op(name, backend)`` returns the callable for one op on one backend.

Layers call this once, when they are built, and keep the callable; nothing switches backends later.
Every op has the same stem in ``toolkit/ref`` (NumPy reference), ``toolkit/cpu`` (Numba) and, for the
GPU, ``toolkit/gpu`` and ``cuda_src/<op>.cu``.
"""
from __future__ import annotations

import importlib

from .backend import DEVICE_BACKENDS, resolve_backend
from .errors import BackendError

OPS = ("rms_norm", "rope", "attention", "topk_softmax", "topk_sigmoid", "topk_softmax_grouped", "silu_and_mul", "clamped_swiglu", "moe_bias_add", "moe_experts",
       "moe_align", "moe_gemm", "moe_combine", "fused_moe", "qlinear", "kv_store", "kv_attention",
       "mla_q", "mla_kv", "mla_out", "embedding", "add", "bias_add", "gated_add", "clip", "gather_rows", "positions", "sample", "nll")
_PACKAGES = {"numpy": "toolkit.ref", "numba": "toolkit.cpu"}


def get_op(name: str, backend: str):
    """The op's callable on one backend. ``cuda`` / ``cuda-emu`` ops take and return device arrays
    (``toolkit/gpu/ops.py``); the NumPy and Numba ones take NumPy arrays."""
    if name not in OPS:
        raise BackendError(f"unknown op {name!r}; ops: {', '.join(OPS)}")
    b = resolve_backend(backend)
    if b in DEVICE_BACKENDS:
        from .gpu.ops import op

        return op(name, b)
    try:
        module = importlib.import_module(f"{_PACKAGES[b]}.{name}")
    except ModuleNotFoundError as e:
        raise BackendError(f"op {name!r} has no {b!r} implementation") from e
    return getattr(module, name)
