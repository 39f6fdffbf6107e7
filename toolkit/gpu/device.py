"""Devices: where the CUDA backend's arrays live and its kernels run, behind one small interface.

A :class:`Device` offers ``xp`` (array creation: ``empty``, ``zeros``, ``full``), ``to_device`` / ``copy_in``
(host -> device, counted), ``to_host`` (device -> host, counted), ``launch`` (a kernel of ``cuda_src/``),
``gemm`` (``out = a @ b.T``, cuBLAS on a GPU) and ``memset``. Two implementations:

- :class:`CupyDevice`: CuPy on a real GPU (kernels compiled by NVRTC into ``cupy.RawModule``s, one per
  ``cuda_src/<stem>.cu``, cached for the process; cuBLAS through ``cupy.matmul``).
- :class:`EmuDevice`: "device" memory in host RAM, wrapped in :class:`EmuArray`, every launch run by the CPU
  emulation layer of ``cuda_src/emu`` (``toolkit/gpu/emulate.py``). Like CuPy, an ``EmuArray`` refuses an
  implicit conversion to NumPy; reading a value on the host (``int(a)``) counts as a synchronisation. Its
  options (thread order, an architecture, the AddressSanitizer build) are what the emulated tests vary.

Every launcher (``run_<op>(dev, ...)`` in ``toolkit/gpu/<op>.py``) is written against this interface alone: it
uses ``dev.xp``, ``dev.launch`` and ``dev.arch``, and never reads a device array back.

Both count bytes copied in and out, launches, GEMMs and host synchronisations (``counters``), so a test can
prove what crosses the bus per decode step. :class:`Plan` records a step (every launch, GEMM and memset
with its buffers) and replays it: the decode step is recorded once per batch shape; on a GPU the replay can
be captured as a CUDA graph (``Plan.capture``). While recording on the emulated device, any array
computation that is not a launch raises, so whatever is recorded is exactly what a replay (or a graph)
re-runs.
"""
from __future__ import annotations

import os

import contextlib
import functools
import warnings
from dataclasses import dataclass, field

import numpy as np
import numpy.lib.mixins as mixins

from ..errors import BackendError


@dataclass
class Counters:
    bytes_in: int = 0
    bytes_out: int = 0
    launches: int = 0
    gemms: int = 0
    syncs: int = 0

    def snapshot(self) -> "Counters":
        return Counters(**vars(self))

    def since(self, before: "Counters") -> "Counters":
        return Counters(**{k: getattr(self, k) - getattr(before, k) for k in vars(self)})


@dataclass
class Plan:
    """A recorded sequence of device steps (launches, GEMMs, memsets) with the buffers they use."""

    steps: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # buffers allocated while recording (they must outlive the plan)
    graph: object = None  # a captured CUDA graph (CupyDevice.capture)

    def replay(self, device) -> None:
        if self.graph is not None:
            device.replay_graph(self)
            return
        for step in self.steps:
            step()

    def capture(self, device) -> bool:
        """Capture the steps as a CUDA graph where the device can (a GPU); returns whether it did."""
        if not hasattr(device, "capture"):
            return False
        device.capture(self)
        return True


class Device:
    """The interface; subclasses implement ``_alloc``, ``_launch``, ``_gemm``, ``_memset``, transfers."""

    name = "device"
    # ``gemm`` inside a recorded step (decode) runs cuda_src/linear.cu instead of the device's GEMM: a GPU's
    # recorded step may be captured as a CUDA graph, which cuBLAS cannot join through CuPy
    linear_kernel = False
    sm_count = 132  # SMs the launchers plan grids for: an H100 / H200 (the emulated device); a GPU reports its own

    def __init__(self):
        self.counters = Counters()
        self._plan: Plan | None = None

    def resident_blocks(self, stem: str, kernel: str, threads: int, promised: int, shared_mem: int = 0) -> int:
        """Blocks of ``kernel`` (``threads`` each, ``shared_mem`` bytes of dynamic shared memory) one SM runs at
        once: the driver's occupancy query on a GPU;
        here ``promised``, the minimum its ``__launch_bounds__`` asks of the compiler (a lower bound of what the
        NVRTC figures of ``toolkit.gpu.occupancy`` give: 4-6 blocks at block_m 16 on sm_90)."""
        return promised

    # ---- recording ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, plan: Plan):
        """Run a step eagerly while appending every launch / GEMM / memset to ``plan``."""
        if self._plan is not None:
            raise BackendError(f"{self.name}: already recording a plan")
        self._plan = plan
        try:
            yield plan
        finally:
            self._plan = None

    @property
    def is_recording(self) -> bool:
        return self._plan is not None

    def _run(self, step) -> None:
        if self._plan is not None:
            self._plan.steps.append(step)
        step()

    # ---- the operations -------------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32):
        a = self._alloc(tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape, dtype)
        if self._plan is not None:
            self._plan.keep.append(a)
        return a

    def zeros(self, shape, dtype=np.float32):
        return self.full(shape, 0, dtype)

    def full(self, shape, value, dtype=np.float32):
        a = self.empty(shape, dtype)
        self.memset(a, value)
        return a

    def memset(self, a, value) -> None:
        self._run(functools.partial(self._memset, a, value))

    def launch(self, stem: str, kernel: str, grid, block, args, shared_mem: int = 0) -> None:
        """``shared_mem``: bytes of dynamic shared memory per block (the kernel's ``extern __shared__``)."""
        def step():
            self.counters.launches += 1
            self._launch(stem, kernel, tuple(grid), tuple(block), tuple(args), int(shared_mem))

        self._run(step)

    def gemm(self, a, b, out) -> None:
        """``out [M, N] = a [M, K] @ b [N, K].T`` (f32). Inside a recorded step on a device with ``linear_kernel``
        (a GPU: its steps may be captured as CUDA graphs, which CuPy keeps cuBLAS out of) it is cuda_src/linear.cu,
        so the step gives the same bits replayed eagerly and as a graph; else the device's GEMM (cuBLAS)."""
        if self._plan is not None and self.linear_kernel:
            from .linear import run_linear

            run_linear(self, a, b, out)
            return

        def step():
            self.counters.gemms += 1
            self._gemm(a, b, out)

        self._run(step)

    def to_device(self, a: np.ndarray):
        """A new device array holding a copy of host ``a`` (counted)."""
        a = np.ascontiguousarray(a)
        d = self._alloc(a.shape, a.dtype)
        self.copy_in(d, a)
        return d

    def copy_in(self, dst, a: np.ndarray) -> None:
        """Host ``a`` into the existing device buffer ``dst`` (counted)."""
        a = np.ascontiguousarray(a, dtype=dst.dtype)
        if tuple(a.shape) != tuple(dst.shape):
            raise BackendError(f"{self.name}: copy_in of {a.shape} into a buffer of {tuple(dst.shape)}")
        self.counters.bytes_in += a.nbytes
        self._copy_in(dst, a)

    def to_host(self, d) -> np.ndarray:
        out = self._to_host(d)
        self.counters.bytes_out += out.nbytes
        return out


# ---- the emulated device ---------------------------------------------------------------------------------
def garbage(shape, dtype=np.float64) -> np.ndarray:
    """Fresh emulated device memory: garbage, as a GPU's may hold (NaN for floats, 0x5A bytes otherwise), so a
    kernel that leaves part of an output unwritten, or reads what it never wrote, shows."""
    a = np.empty(shape, dtype)
    if a.dtype.kind == "f":
        a.fill(np.nan)
    else:
        a.view(np.uint8).fill(0x5A)
    return a


def _unwrap(x):
    if isinstance(x, EmuArray):
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


class EmuArray(mixins.NDArrayOperatorsMixin):
    """A device array of the emulated device: NumPy storage that, like a CuPy array, is not a NumPy array."""

    __slots__ = ("_a", "_dev")

    def __init__(self, a: np.ndarray, dev: "EmuDevice"):
        self._a, self._dev = a, dev

    # metadata and views: no computation
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: EmuArray(self._a.T, self._dev))

    def __len__(self):
        return len(self._a)

    def reshape(self, *shape):
        v = self._a.reshape(*shape)
        if not np.shares_memory(v, self._a):
            raise BackendError("emulated device: reshape would copy (the array is not contiguous)")
        return EmuArray(v, self._dev)

    def view(self, dtype=None):
        return EmuArray(self._a.view(dtype) if dtype is not None else self._a.view(), self._dev)

    def ravel(self):
        return self.reshape(-1)

    def __getitem__(self, idx):
        if isinstance(idx, (EmuArray, np.ndarray)) or (isinstance(idx, tuple) and any(
                isinstance(i, (EmuArray, np.ndarray, list)) for i in idx)):
            self._dev.compute("advanced indexing")
        v = self._a[_unwrap(idx)]
        return EmuArray(v, self._dev) if isinstance(v, np.ndarray) else self._sync(v)

    def __setitem__(self, idx, value):
        if isinstance(value, np.ndarray):
            raise BackendError("emulated device: assigning a host array into device memory; use device.copy_in")
        self._dev.compute("item assignment")
        self._a[_unwrap(idx)] = _unwrap(value)

    # implicit host conversions: refused, as CuPy refuses them
    def __array__(self, *a, **k):
        raise TypeError("emulated device array: implicit conversion to a NumPy array is not allowed; "
                        "use device.to_host (counted)")

    def _sync(self, v):
        self._dev.counters.syncs += 1
        self._dev.counters.bytes_out += np.asarray(v).nbytes
        return v

    def item(self):
        return self._sync(self._a.item())

    def __int__(self):
        return int(self.item())

    def __float__(self):
        return float(self.item())

    def __bool__(self):
        return bool(self.item())

    def __index__(self):
        return int(self.item())

    def tolist(self):
        return self._sync(self._a).tolist()

    # computation (a CuPy kernel on a GPU): allowed eagerly, refused while recording a plan
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        self._dev.compute(f"ufunc {ufunc.__name__}")
        out = getattr(ufunc, method)(*_unwrap(inputs), **_unwrap(kwargs))
        return self._dev.wrap(out)

    def __array_function__(self, func, types, args, kwargs):
        self._dev.compute(f"numpy.{func.__name__}")
        return self._dev.wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    def astype(self, dtype, copy=True):
        self._dev.compute("astype")
        return EmuArray(self._a.astype(dtype, copy=copy), self._dev)

    def copy(self):
        self._dev.compute("copy")
        return EmuArray(self._a.copy(), self._dev)

    def __repr__(self):
        return f"EmuArray(shape={self.shape}, dtype={self.dtype})"


class _XP:
    """A device's array namespace (``xp``): array creation goes through the device (recorded memsets)."""

    def __init__(self, dev):
        self._dev = dev

    def empty(self, shape, dtype=np.float32):
        return self._dev.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        return self._dev.zeros(shape, dtype)

    def full(self, shape, value, dtype=np.float32):
        return self._dev.full(shape, value, dtype)


class _EmuXP(_XP):
    """The emulated device's namespace: everything beyond creation is NumPy on the unwrapped storage,
    wrapped back."""

    ndarray = EmuArray

    def asarray(self, a, dtype=None):
        if isinstance(a, EmuArray):
            return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
        return self._dev.to_device(np.asarray(a, dtype=dtype))

    def ascontiguousarray(self, a, dtype=None):
        if isinstance(a, EmuArray) and a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
            return a
        if isinstance(a, EmuArray):
            self._dev.compute("ascontiguousarray")
            return EmuArray(np.ascontiguousarray(a._a, dtype=dtype), self._dev)
        return self._dev.to_device(np.ascontiguousarray(a, dtype=dtype))

    def __getattr__(self, name):
        fn = getattr(np, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self._dev.compute(f"numpy.{name}")
            return self._dev.wrap(fn(*_unwrap(args), **_unwrap(kwargs)))

        return call


class EmuDevice(Device):
    """The CUDA backend emulated on the CPU (``--backend cuda-emu``): every kernel of ``cuda_src/`` runs
    through ``cuda_src/emu`` (one fiber per CUDA thread), device memory is host RAM that the host cannot
    read without a counted copy.

    ``mode``: 'fibers', or 'asan' (the AddressSanitizer build: a process whose environment preloads the ASan
    runtime, ``emulate.asan_env()``). ``reverse``: every block runs its threads backwards; ``arch`` (e.g. 800,
    900): the launchers plan for that architecture and the kernels are built with ``__CUDA_ARCH__`` set to it
    (moe_gemm_tiled's WMMA path, emulated). Either None: read MOQE_EMU_REVERSE / MOQE_EMU_ARCH at each use, as
    ``--backend cuda-emu`` does (its one device is shared by the process). ``select(name)`` limits the
    instantiations built (a slow ASan build of moe_gemm needs only a few). ``linear_kernel``: a recorded step's dense
    GEMMs run cuda_src/linear.cu as on a GPU; off by default (np.matmul stands in for cuBLAS: an emulated LM head
    costs seconds a step)."""

    name = "cuda-emu"

    def __init__(self, mode: str = "fibers", reverse: bool | None = None, select=None, arch: int | None = None,
                 linear_kernel: bool = False):
        super().__init__()
        self.mode, self.select, self._reverse, self._arch = mode, select, reverse, arch
        self.linear_kernel = linear_kernel
        self.xp = _EmuXP(self)
        self.launched: set[str] = set()  # every kernel name expression launched so far (tests read it)

    @property
    def arch(self) -> int | None:
        """MOQE_EMU_ARCH=900: the launchers plan as for an sm_90 device (tensor-core GEMM and prefill attention,
        routed experts repacked at upload), and the emulator runs those kernels like every other one (built
        without ``__CUDA_ARCH__``: only an ``arch`` given to the constructor sets it). Read at each use (the
        device object is shared by the process); unset: None, the f32 kernels."""
        if self._arch is not None:
            return self._arch
        return int(os.environ.get("MOQE_EMU_ARCH", "0") or 0) or None

    @property
    def reverse(self) -> bool:
        """MOQE_EMU_REVERSE=1: every block runs its threads in reverse order (a kernel whose result depends on the
        order its threads run in, a missing __syncthreads, shows up as a different answer). Read at each launch."""
        if self._reverse is not None:
            return self._reverse
        return os.environ.get("MOQE_EMU_REVERSE", "0") == "1"

    def wrap(self, out):
        if isinstance(out, np.ndarray):
            return EmuArray(out, self)
        if isinstance(out, tuple):
            return tuple(self.wrap(o) for o in out)
        return out

    def compute(self, what: str) -> None:
        if self._plan is not None:
            raise BackendError(f"cuda-emu: {what} on device arrays while recording a plan: only launches, GEMMs "
                               f"and memsets are replayed, so a recorded step must use kernels alone")

    def _alloc(self, shape, dtype):
        return EmuArray(garbage(shape, dtype), self)

    def _memset(self, a, value):
        a._a[...] = value

    def _launch(self, stem, kernel, grid, block, args, shared_mem=0):
        from . import emulate
        from .source import cu_path, kernels

        self.launched.add(kernel)
        names = tuple(k for k in kernels(stem) if self.select is None or self.select(k))
        module = emulate.module(cu_path(stem), names, self.mode, self._arch)
        module.launch(kernel, grid, block, [_unwrap(a) for a in args], self.reverse)

    def _gemm(self, a, b, out):
        np.matmul(a._a, b._a.T, out=out._a)

    def _copy_in(self, dst, a):
        dst._a[...] = a

    def _to_host(self, d):
        return np.array(d._a)


# ---- a real GPU ----------------------------------------------------------------------------------------
class _CupyXP(_XP):
    """CuPy's namespace; creation and host arrays go through the device (counted)."""

    def asarray(self, a, dtype=None):
        import cupy

        if isinstance(a, cupy.ndarray):
            return a if dtype is None else a.astype(dtype, copy=False)
        return self._dev.to_device(np.asarray(a, dtype=dtype))

    def ascontiguousarray(self, a, dtype=None):
        import cupy

        if isinstance(a, cupy.ndarray):
            return cupy.ascontiguousarray(a, dtype=dtype)
        return self._dev.to_device(np.ascontiguousarray(a, dtype=dtype))

    def __getattr__(self, name):
        import cupy

        return getattr(cupy, name)


@functools.cache
def _raw_module(stem: str, arch: int):
    """``cuda_src/<stem>.cu`` compiled by NVRTC with every name expression its launcher uses (``KERNELS``), and the
    name each kernel is looked up by. CuPy compiles it, except where the stem needs an architecture-specific target
    CuPy cannot pass (``sm_90a``: wgmma): then its cubin from ``nvrtc.build``, loaded by mangled name."""
    import cupy

    from .source import arch_name, cu_path, kernels, nvrtc_options

    if arch_name(stem, arch // 10).endswith("a"):
        import hashlib
        from pathlib import Path

        from ..paths import cache_dir
        from ..writes import atomic_write
        from . import nvrtc

        cubin, lowered = nvrtc.build(stem, arch // 10)
        path = Path(cache_dir("cubin")) / f"{stem}-{hashlib.sha256(cubin).hexdigest()[:24]}.cubin"
        if not path.is_file():
            with atomic_write(path) as f:
                f.write(cubin)
        return cupy.RawModule(path=str(path)), lowered
    module = cupy.RawModule(code=cu_path(stem).read_text(), options=nvrtc_options(), name_expressions=list(kernels(stem)))
    return module, {}


def _function(stem: str, kernel: str, arch: int):
    module, lowered = _raw_module(stem, arch)
    return module.get_function(lowered.get(kernel, kernel))


class CupyDevice(Device):
    """CuPy on a real GPU; kernels through ``cupy.RawModule`` (one per source file, compiled at first launch and
    kept for the process)."""

    name = "cuda"
    linear_kernel = True

    def __init__(self):
        super().__init__()
        from ..backend import cuda_unavailable_reason

        why = cuda_unavailable_reason()
        if why is not None:
            raise BackendError(f"backend 'cuda': {why}; use --backend cuda-emu to run the CUDA kernels emulated on the CPU")
        import cupy

        self.cupy = cupy
        self.xp = _CupyXP(self)
        self.arch = int(cupy.cuda.Device().compute_capability) * 10  # e.g. 900: moe_gemm runs on tensor cores
        self.sm_count = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        self._resident: dict = {}
        self.stream = cupy.cuda.Stream(non_blocking=True)  # every operation of this device is ordered on it

    def _alloc(self, shape, dtype):
        with self.stream:
            return self.cupy.empty(shape, dtype)

    def _memset(self, a, value):
        with self.stream:
            a.fill(value)

    def _launch(self, stem, kernel, grid, block, args, shared_mem=0):
        with self.stream:
            fn = _function(stem, kernel, self.arch)
            if shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_mem:
                fn.max_dynamic_shared_size_bytes = shared_mem  # past the 48 KB default: the kernel must opt in
            fn(grid, block, args, shared_mem=shared_mem)

    def resident_blocks(self, stem: str, kernel: str, threads: int, promised: int, shared_mem: int = 0) -> int:
        key = (stem, kernel, threads, shared_mem)
        if key not in self._resident:
            from cupy_backends.cuda.api import driver

            fn = _function(stem, kernel, self.arch)  # a RawKernel; .kernel.ptr is its CUfunction
            try:
                n = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, shared_mem))
            except Exception as e:  # the grid is only planned from it: warn, and plan for what the bounds promise
                warnings.warn(f"occupancy query of {kernel} failed ({e}); planning for {promised} blocks per SM")
                n = promised
            self._resident[key] = max(1, n)
        return self._resident[key]

    def _gemm(self, a, b, out):
        with self.stream:
            self.cupy.matmul(a, b.T, out=out)

    def _copy_in(self, dst, a):
        dst.set(a, stream=self.stream)

    def _to_host(self, d):
        return self.cupy.asnumpy(d, stream=self.stream, blocking=True)

    def capture(self, plan: Plan) -> None:
        """Capture ``plan``'s steps as a CUDA graph (then ``Plan.replay`` launches the graph). Run the plan
        once eagerly first (recording it), so every kernel is compiled; a recorded step's dense GEMMs are
        cuda_src/linear.cu (``linear_kernel``), never cuBLAS, which CuPy refuses to call during a capture."""
        with self.stream:
            self.stream.begin_capture()
            try:
                for step in plan.steps:
                    step()
            finally:
                plan.graph = self.stream.end_capture()

    def replay_graph(self, plan: Plan) -> None:
        plan.graph.launch(self.stream)
        self.counters.launches += len(plan.steps)


@functools.cache
def device(backend: str) -> Device:
    """The device of a backend name: ``cuda`` (a GPU through CuPy) or ``cuda-emu`` (the CPU emulation)."""
    if backend == "cuda":
        return CupyDevice()
    if backend == "cuda-emu":
        return EmuDevice()
    raise BackendError(f"backend {backend!r} has no device (cuda, cuda-emu)")
