"""Runners: where a launch plan (``run_<op>(rt, ...)`` in each ``toolkit/gpu/<op>.py``) executes.

A runner offers ``xp`` (the array module: NumPy or CuPy), ``launch(stem, kernel, grid, block, args)`` and
``host(a)`` (a NumPy copy). ``CupyRunner`` compiles ``cuda_src/<stem>.cu`` with ``cupy.RawModule`` (the
name expressions of the op's ``KERNELS``; ``-I`` the CUDA headers, which NVRTC does not find on its own).
``EmuRunner`` runs the same source on the CPU through :mod:`toolkit.gpu.emulate`.
"""
from __future__ import annotations

import functools

import numpy as np

from ..backend import cuda_unavailable_reason
from ..errors import BackendError
from . import emulate
from .source import CUDA_SRC, cu_path, cuda_include_dirs, kernels

NULL = np.uint64(0)  # a null pointer argument (8 bytes, like a device pointer)
NVRTC_OPTIONS = ("-std=c++17",)


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


class EmuRunner:
    """Kernels emulated on the CPU (``mode`` 'fibers' or 'asan'; ``reverse`` runs threads backwards;
    ``arch=800`` takes the ``__CUDA_ARCH__ >= 800`` paths, WMMA emulated).
    ``select(name)`` limits the instantiations built (a slow ASan build of moe_gemm needs only a few)."""

    xp = np

    def __init__(self, mode: str = "fibers", reverse: bool = False, select=None, arch: int | None = None):
        self.mode, self.reverse, self.select, self.arch = mode, reverse, select, arch

    def launch(self, stem: str, kernel: str, grid, block, args) -> None:
        names = tuple(k for k in kernels(stem) if self.select is None or self.select(k))
        emulate.module(cu_path(stem), names, self.mode, self.arch).launch(kernel, grid, block, args, self.reverse)

    @staticmethod
    def host(a):
        return np.asarray(a)


@functools.cache
def _raw_module(stem: str):
    import cupy

    inc = cuda_include_dirs()
    if not inc:
        raise BackendError("cuda backend: cuda_fp16.h not found; install the cuda12/cuda13 extra (CUDA headers)")
    return cupy.RawModule(code=cu_path(stem).read_text(), options=(*NVRTC_OPTIONS, *(f"-I{d}" for d in inc), f"-I{CUDA_SRC}"),
                          name_expressions=list(kernels(stem)))


class CupyRunner:
    """Kernels on the GPU through CuPy (needs a device: ``cupy.cuda.is_available()``)."""

    def __init__(self):
        why = cuda_unavailable_reason()
        if why is not None:
            raise BackendError(f"cuda backend: {why}")
        import cupy

        self.xp = cupy
        self.arch = int(cupy.cuda.Device().compute_capability) * 10  # e.g. 900: picks the tensor-core kernels

    def launch(self, stem: str, kernel: str, grid, block, args) -> None:
        _raw_module(stem).get_function(kernel)(tuple(grid), tuple(block), tuple(args))

    @staticmethod
    def host(a):
        import cupy

        return cupy.asnumpy(a)


@functools.cache
def gpu() -> CupyRunner:
    return CupyRunner()


def to_device(rt, a):
    return rt.xp.ascontiguousarray(rt.xp.asarray(a))
