"""Backends, resolved once when an object is built (never through a global switch).

- ``numpy``: the reference implementation of every op; the specification.
- ``numba``: the fast CPU kernels, each tested against the reference.
- ``cuda``:  CUDA C kernels from ``cuda_src/`` launched through CuPy (available only with a GPU).
"""
from __future__ import annotations

import functools

from .errors import BackendError

BACKENDS = ("numpy", "numba", "cuda")


@functools.cache
def _cuda_available() -> bool:
    try:
        import cupy  # noqa: F401

        return bool(cupy.cuda.is_available())
    except Exception:  # no cupy, no driver, no device
        return False


def available_backends() -> tuple[str, ...]:
    return tuple(b for b in BACKENDS if b != "cuda" or _cuda_available())


def resolve_backend(name: str) -> str:
    """Validate a backend name and check that it can run here; returns the canonical name."""
    key = str(name).lower()
    if key not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if key == "cuda" and not _cuda_available():
        raise BackendError("backend 'cuda' needs CuPy and a CUDA GPU; neither was found (cupy.cuda.is_available() is False)")
    return key
