"""Run the kernels of ``cuda_src/<stem>.cu`` on the CPU: g++ + ``cuda_src/emu/cuda_emu.h`` + ctypes.

``module(stem, kernels, mode)`` compiles the .cu together with a generated ``extern "C"`` shim (one
``emu_launch_<i>`` per name expression, plus its argument sizes) into a shared library cached under
``$MOQE_EMU_CACHE`` (default: ``~/.cache/moqe/cuda-emu``, ``toolkit/paths.py``) by a hash of the sources, flags and shim; nothing
compiled is ever committed. Modes:

- ``fibers``: one ucontext fiber per CUDA thread (the default; ``reverse=True`` runs a block's threads in
  reverse order, so a missing ``__syncthreads`` shows up);
- ``arch=800`` (either mode): compile with ``__CUDA_ARCH__=800`` so the tensor-core paths run, on the
  emulated WMMA of ``cuda_src/emu/include/mma.h``;
- ``asan``: one OS thread per CUDA thread, built with ``-fsanitize=address``. The library needs the ASan
  runtime loaded first: use it in a process started with ``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``
  (``asan_env()`` returns that environment).

Kernel arguments follow CuPy's ``RawKernel`` convention: NumPy arrays (C-contiguous) become device
pointers, NumPy scalars are passed by value with their own size (``np.int32``, ``np.float32``,
``np.uint64(0)`` for a null pointer). Sizes are checked against the kernel's signature.
This module imports nothing from the toolkit, so an ASan subprocess can load it on its own.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np

EMU_DIR = Path(__file__).resolve().parents[2] / "cuda_src" / "emu"
CXX = os.environ.get("CXX", "g++")
FLAGS = {
    "fibers": ["-O1"],
    "asan": ["-O1", "-g", "-DCUDA_EMU_THREADS", "-pthread", "-fsanitize=address", "-fno-omit-frame-pointer"],
}


WATCHERS: list = []  # objects with on_start(what) / on_end(what), told around every g++ build (not a cache hit)


def cache_dir() -> Path:
    from ..paths import cache_dir as user_cache

    d = Path(os.environ.get("MOQE_EMU_CACHE") or user_cache("cuda-emu"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def asan_env() -> dict:
    lib = subprocess.run([CXX, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout.strip()
    return {**os.environ, "LD_PRELOAD": lib, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}


def _shim(cu: Path, kernels: tuple[str, ...]) -> str:
    lines = [f'#include "{cu}"', 'extern "C" void emu_set_reverse(int r) { emu::g_reverse = r; }',
             'extern "C" const char* emu_last_error() { return emu::g_error; }',
             'extern "C" void emu_set_globals(int n, const unsigned long long* at, const unsigned long long* size) {',
             '  emu::g_globals.clear();',
             '  for (int i = 0; i < n; ++i) emu::g_globals.emplace_back(at[i], at[i] + size[i]);',
             '}']
    for i, k in enumerate(kernels):
        lines.append(f'extern "C" int emu_launch_{i}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
                     f'unsigned bz, void** a) {{ return emu::launch(&{k}, dim3(gx, gy, gz), dim3(bx, by, bz), a); }}')
        lines.append(f'extern "C" int emu_argsizes_{i}(int* out) {{ return emu::arg_sizes(&{k}, out); }}')
    return "\n".join(lines) + "\n"


def build(cu: Path, kernels: tuple[str, ...], mode: str = "fibers", arch: int | None = None) -> Path:
    """``arch``: define ``__CUDA_ARCH__`` (e.g. 800) to emulate the code paths guarded for that architecture
    (WMMA through emu/include/mma.h); None: the scalar paths a build without ``__CUDA_ARCH__`` takes."""
    cu = Path(cu).resolve()
    shim = _shim(cu, kernels)
    flags = [*FLAGS[mode], *([f"-D__CUDA_ARCH__={int(arch)}"] if arch else [])]
    h = hashlib.sha1()
    deps = sorted(EMU_DIR.rglob("*.h")) + sorted({*cu.parent.glob("*.cuh"), *EMU_DIR.parent.glob("*.cuh")})
    for part in [shim, cu.read_text(), CXX, mode, *flags, *(p.read_text() for p in deps)]:
        h.update(part.encode())
    out = cache_dir() / f"{cu.stem}-{mode}{arch or ''}-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    src = out.with_suffix(".cpp")
    src.write_text(shim)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [CXX, "-std=c++20", *flags, "-shared", "-fPIC", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas",
           f"-I{EMU_DIR / 'include'}", f"-I{EMU_DIR.parent}", "-include", str(EMU_DIR / "cuda_emu.h"), str(src), "-o", str(tmp)]
    for w in list(WATCHERS):  # a build counts as compilation, as Numba's does (toolkit.warmup.compile_watch)
        w.on_start(cu.name)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        for w in list(WATCHERS):
            w.on_end(cu.name)
    if r.returncode:
        raise RuntimeError(f"emulation build of {cu.name} failed:\n{' '.join(cmd)}\n{r.stderr[-6000:]}")
    os.replace(tmp, out)
    return out


class Module:
    """A compiled emulation library; ``launch(kernel, grid, block, args)`` as CuPy's ``RawKernel``."""

    def __init__(self, cu: Path, kernels: tuple[str, ...], mode: str = "fibers", arch: int | None = None):
        self.kernels = {k: i for i, k in enumerate(kernels)}
        self.lib = ctypes.CDLL(str(build(cu, kernels, mode, arch)))
        self.name = Path(cu).name

    def launch(self, kernel: str, grid, block, args, reverse: bool = False) -> None:
        if kernel not in self.kernels:
            raise KeyError(f"{self.name}: kernel {kernel!r} is not among the compiled name expressions {list(self.kernels)}")
        i = self.kernels[kernel]
        sizes = (ctypes.c_int * 64)()
        n = getattr(self.lib, f"emu_argsizes_{i}")(sizes)
        if n != len(args):
            raise TypeError(f"{self.name}: {kernel} takes {n} arguments, got {len(args)}")
        keep, ptrs = [], (ctypes.c_void_p * max(1, n))()
        for j, a in enumerate(args):
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{self.name}: {kernel} argument {j} is not C-contiguous")
                buf, size = ctypes.c_void_p(a.ctypes.data), 8
            elif isinstance(a, np.generic):
                raw = a.tobytes()
                buf, size = (ctypes.c_char * len(raw)).from_buffer_copy(raw), len(raw)
            else:
                raise TypeError(f"{self.name}: {kernel} argument {j} must be a NumPy array or scalar, got {type(a).__name__}")
            if size != sizes[j]:
                raise TypeError(f"{self.name}: {kernel} argument {j} has {size} bytes, the kernel takes {sizes[j]}")
            keep.append(buf)
            ptrs[j] = ctypes.cast(ctypes.pointer(buf), ctypes.c_void_p)
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self.lib.emu_set_reverse(int(bool(reverse)))
        arrays = [a for a in args if isinstance(a, np.ndarray)]  # what __ldg and cp.async may read (cuda_emu.h)
        at = (ctypes.c_ulonglong * max(1, len(arrays)))(*(a.ctypes.data for a in arrays))
        nbytes = (ctypes.c_ulonglong * max(1, len(arrays)))(*(a.nbytes for a in arrays))
        self.lib.emu_set_globals(len(arrays), at, nbytes)
        rc = getattr(self.lib, f"emu_launch_{i}")(*(ctypes.c_uint(int(v)) for v in g + b), ptrs)
        if rc:
            self.lib.emu_last_error.restype = ctypes.c_char_p
            raise RuntimeError(f"{self.name}: emulated launch of {kernel} failed: {self.lib.emu_last_error().decode()}")


@functools.cache
def module(cu: Path, kernels: tuple[str, ...], mode: str = "fibers", arch: int | None = None) -> Module:
    return Module(Path(cu), tuple(kernels), mode, arch)
