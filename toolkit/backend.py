"""Backends, resolved once when an object is built (never through a global switch).

- ``numpy``: the reference implementation of every op; the specification.
- ``numba``: the fast CPU kernels, each tested against the reference.
- ``cuda``:  CUDA C kernels from ``cuda_src/`` launched through CuPy (available only with a GPU); weights, KV
  cache and activations stay on the device.
- ``cuda-emu``: the same, on an emulated device: every kernel runs on the CPU through ``cuda_src/emu``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import BackendError


@dataclass(frozen=True)
class Capabilities:
    """What a backend does beyond running the ops, looked up once where a model's runtime is built
    (``capabilities(name)``), so nothing downstream compares a backend's name."""

    on_device: bool = False  # arrays live on a device (toolkit/gpu/device.py); a step copies ids in and out only
    prepares_weights: bool = False  # quantized weights packed for the kernels as they are placed, for the expert
    # GEMMs' activation kind (--activations int8 / f32)
    compiled_decode: bool = False  # a one-token step runs each layer as one compiled call (toolkit/model/
    # decode_step.py, with its own token loops such as the KV rotation's), built ahead by a helper process
    gemv16: bool = False  # a 16-bit GEMV reads f16 / bf16 weights as stored: the embeddings and LM head stay
    # 16-bit at every size, dense projections from Runtime's DENSE16_MIN


CAPABILITIES = {
    "numpy": Capabilities(),
    "numba": Capabilities(prepares_weights=True, compiled_decode=True, gemv16=True),
    "cuda": Capabilities(on_device=True),
    "cuda-emu": Capabilities(on_device=True),
}
BACKENDS = tuple(CAPABILITIES)
DEVICE_BACKENDS = tuple(b for b, c in CAPABILITIES.items() if c.on_device)


def capabilities(name: str) -> Capabilities:
    if name not in CAPABILITIES:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return CAPABILITIES[name]


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """None when CuPy finds a usable CUDA device; else why not (the one check every caller shares)."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e}); install the cuda12 or cuda13 extra"
    try:
        if cupy.cuda.is_available():
            return None
    except Exception as e:  # driver / runtime problems
        return f"CuPy finds no usable CUDA device ({type(e).__name__}: {e})"
    return "no CUDA device: cupy.cuda.is_available() is False"


def _cuda_available() -> bool:
    return cuda_unavailable_reason() is None


def available_backends() -> tuple[str, ...]:
    return tuple(b for b in BACKENDS if b != "cuda" or _cuda_available())


def resolve_backend(name: str) -> str:
    """Validate a backend name and check that it can run here; returns the canonical name.
    ``cuda-emu`` runs the CUDA backend with every kernel emulated on the CPU (slow; for checking)."""
    key = str(name).lower()
    if key not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if key == "cuda" and not _cuda_available():
        raise BackendError(f"backend 'cuda' needs CuPy and a CUDA GPU: {cuda_unavailable_reason()}; "
                           f"--backend cuda-emu runs the same kernels emulated on the CPU")
    return key
