"""Where the CUDA sources and headers are: ``cuda_src/<stem>.cu``, the emulation header, the CUDA includes.

NVRTC has no default include path (REFERENCE §6): :func:`cuda_include_dirs` finds ``cuda_fp16.h`` in the pip
CUDA packages (``nvidia/cu13/include`` for ``cuda-toolkit[nvrtc,cudart,crt]==13.*``, ``nvidia/cuda_runtime/include``
for the cuda12 wheels), then ``$CUDA_PATH/include`` and ``/usr/local/cuda/include``; and ``crt/mma.h`` (WMMA,
``nvidia/cuda_nvcc/include`` in the cuda12 wheels).
"""
from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
EMU_DIR = CUDA_SRC / "emu"
NVRTC_OPTIONS = ("-std=c++17",)


def cu_path(stem: str) -> Path:
    return CUDA_SRC / f"{stem}.cu"


def kernels(stem: str) -> tuple[str, ...]:
    """The name expressions (kernels and template instantiations) the launcher of ``stem`` uses."""
    return tuple(importlib.import_module(f"toolkit.gpu.{stem}").KERNELS)


def arch_name(stem: str, arch: int) -> str:
    """The ``-arch`` of ``stem`` compiled for ``arch`` (e.g. 90): ``sm_90a`` (the architecture-specific features,
    Hopper's wgmma) where its launcher's ``ARCH_SPECIFIC`` names that architecture, else ``sm_90``."""
    specific = getattr(importlib.import_module(f"toolkit.gpu.{stem}"), "ARCH_SPECIFIC", ())
    return f"sm_{arch}a" if arch in specific else f"sm_{arch}"


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """The include dirs to pass NVRTC: the one with cuda_fp16.h, then the one with crt/mma.h (WMMA) when it
    is elsewhere (cuda12 wheels: nvidia/cuda_runtime/include + nvidia/cuda_nvcc/include). Empty: none found."""
    roots = []
    try:
        import nvidia  # namespace package of the pip CUDA wheels

        for base in nvidia.__path__:
            roots += sorted(Path(base).glob("*/include"))
    except ImportError:
        pass
    try:  # CuPy's own locator (cuda-pathfinder): conda, pip wheels, CUDA_PATH, system installs
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            roots.append(Path(found))
    except Exception:  # noqa: BLE001 - an older CuPy without it, or nothing found
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            roots.append(Path(os.environ[env]) / "include")
    roots += [Path("/usr/local/cuda/include"), *sorted(Path("/usr/local").glob("cuda-*/include"))]
    fp16 = next((r for r in roots if (r / "cuda_fp16.h").is_file()), None)
    if fp16 is None:
        return ()
    crt = next((r for r in [fp16, *roots] if (r / "crt" / "mma.h").is_file()), fp16)
    return tuple(dict.fromkeys([str(fp16), str(crt)]))


def nvrtc_options() -> tuple[str, ...]:
    """The NVRTC options a module of ``cuda_src/`` compiles with on a GPU (``CupyDevice``): C++17, ``-I`` the CUDA
    headers (NVRTC has no default include path) and ``-I cuda_src`` (the shared ``.cuh`` files)."""
    from ..errors import BackendError

    inc = cuda_include_dirs()
    if not inc:
        raise BackendError("cuda backend: cuda_fp16.h not found; install the cuda12/cuda13 extra (CUDA headers)")
    return (*NVRTC_OPTIONS, *(f"-I{d}" for d in inc), f"-I{CUDA_SRC}")
