"""Op dispatch: ``get_op(name, backend)`` returns the callable for one op on one backend.

Layers call this once, when they are built, and keep the callable; nothing switches backends later. The op
list is the reference: every module ``toolkit/ref/<op>.py`` defining a function ``<op>`` is an op (the spec).
A backend implements an op with the same stem: ``toolkit/cpu/<op>.py`` (numba), a method of
``toolkit.gpu.ops.DeviceOps`` over ``toolkit/gpu/<op>.py`` and ``cuda_src/<op>.cu`` (cuda, cuda-emu).
``supports_op`` says whether it does (ggml's ``supports_op``); ``get_op`` of an op a backend lacks is a
``BackendError`` when the layer is built, naming the op, the backend and where it runs instead.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

from .backend import BACKENDS, DEVICE_BACKENDS, resolve_backend
from .errors import BackendError

_PACKAGES = {"numpy": "toolkit.ref", "numba": "toolkit.cpu"}


def _ops_of(package: Path) -> tuple[str, ...]:
    """The stems of ``package/<stem>.py`` that define ``def <stem>(`` at module level (read as text: no import)."""
    return tuple(sorted(p.stem for p in package.glob("*.py")
                        if re.search(rf"^def {re.escape(p.stem)}\(", p.read_text(), re.M)))


OPS = _ops_of(Path(__file__).parent / "ref")
_CPU_OPS = frozenset(_ops_of(Path(__file__).parent / "cpu"))


def supports_op(name: str, backend: str) -> bool:
    """Whether ``backend`` implements op ``name`` (no import of the backend beyond its op table)."""
    if name not in OPS:
        raise BackendError(f"unknown op {name!r}; ops: {', '.join(OPS)}")
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "numpy":
        return True
    if backend == "numba":
        return name in _CPU_OPS
    from .gpu.ops import DEVICE_OPS

    return name in DEVICE_OPS


def get_op(name: str, backend: str):
    """The op's callable on one backend. ``cuda`` / ``cuda-emu`` ops take and return device arrays
    (``toolkit/gpu/ops.py``); the NumPy and Numba ones take NumPy arrays."""
    b = resolve_backend(backend)
    if not supports_op(name, b):
        where = ", ".join(x for x in BACKENDS if supports_op(name, x))
        raise BackendError(f"op {name!r} is not implemented on backend {b!r}; it runs on: {where}")
    if b in DEVICE_BACKENDS:
        from .gpu.ops import op

        return op(name, b)
    return getattr(importlib.import_module(f"{_PACKAGES[b]}.{name}"), name)
