"""The harness of the op tests (tests/test_ops*.py): every op on every backend against its NumPy reference. A test
takes the ``both`` fixture, ``both(op)`` -> (the NumPy reference, the op on this test's backend), and runs once per
entry of ``BACKENDS``: numba (its serial and its parallel builds), cuda-emu (the CUDA kernels emulated on the CPU,
threads in forward and in reverse order) and cuda when a GPU is present. An op a backend does not implement
(``toolkit.ops.supports_op``) is skipped with that reason; a new backend gets every op test by joining ``BACKENDS``.
A test module imports the fixtures by name (``from ops_harness import backend, both``)."""
from __future__ import annotations

import numpy as np
import pytest

from toolkit.backend import DEVICE_BACKENDS, cuda_unavailable_reason
from toolkit.formats import QTensor
from toolkit.ops import get_op, supports_op

RNG = np.random.default_rng(0)
F32_TOL = dict(atol=2e-6, rtol=2e-5)  # f32 kernels that sum in a different order than NumPy


def normal(*shape, scale=1.0):
    """f32 [*shape] of N(0, scale^2)."""
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# (backend, variant): numba's serial and parallel build of every kernel (toolkit/cpu/_jit.py); the emulated CUDA
# kernels with each block's threads in forward and in reverse order (MOQE_EMU_REVERSE)
BACKENDS = [("numba", "serial"), ("numba", "parallel"), ("cuda-emu", None), ("cuda-emu", "reverse"), ("cuda", None)]


@pytest.fixture(params=BACKENDS, ids=[b if k is None else f"{b}-{k}" for b, k in BACKENDS])
def backend(request, monkeypatch):
    name, build = request.param
    if name == "cuda" and cuda_unavailable_reason() is not None:
        pytest.skip(cuda_unavailable_reason())
    if build == "reverse":
        monkeypatch.setenv("MOQE_EMU_REVERSE", "1")
    elif build is not None:
        import toolkit.cpu._jit as jit

        monkeypatch.setattr(jit, "PARALLEL_MIN_WORK", 1 << 62 if build == "serial" else 0)
    return name


def rounds_operands(backend: str) -> bool:
    """Whether ``backend``'s grouped GEMMs (moe_gemm, fused_moe, qlinear, moe_experts) multiply f16 operands on
    tensor cores: ``cuda`` on sm_80+ unless MOQE_CUDA_TENSOR_CORES=0 (moe_gemm_mma; e4m3 for W8A8). Activations
    (and f32 weights) round to f16 there, 2^-11 relative each, so those tests check such a backend within the
    tensor-core tolerance. The emulated device plans without an architecture and runs the f32 kernels."""
    if backend not in DEVICE_BACKENDS:
        return False
    from toolkit.gpu.api import ops_for
    from toolkit.gpu.moe_gemm_mma import tensor_cores

    return tensor_cores(ops_for(backend).dev)


def on_backend(name: str, fn, writes: tuple[int, ...] = ()):
    """``fn`` (an op of backend ``name``) called with NumPy inputs and returning NumPy outputs: on a device the
    arrays go up first (64-bit integers as the int32 the device ops take, a QTensor's arrays, the arrays in a
    tuple) and the results come back; the op itself must not read anything back (a decode step never waits on
    the host), and the emulated device's fresh buffers hold garbage (an output left partly unwritten shows).
    ``writes``: the positions of the arguments the op updates in place (a KV cache, the seen marks); the call
    then returns ``(result, *those arguments after the op)``."""
    if name not in DEVICE_BACKENDS:
        if not writes:
            return fn
        return lambda *args: (fn(*args), *(args[i] for i in writes))
    from toolkit.gpu.api import ops_for, upload_qtensor

    dev = ops_for(name).dev

    def call(*args):
        ins = [up(a) for a in args]
        before = dev.counters.snapshot()
        out = fn(*ins)
        read = dev.counters.since(before)
        assert read.bytes_out == 0 and read.syncs == 0, "the op read a device array back to the host"
        return (down(out), *(down(ins[i]) for i in writes)) if writes else down(out)

    def up(a):
        if isinstance(a, QTensor):
            return upload_qtensor(dev, a)
        if isinstance(a, tuple):
            return tuple(up(x) for x in a)
        if isinstance(a, np.ndarray):
            return dev.to_device(np.ascontiguousarray(a, np.int32 if a.dtype.kind in "iu" and a.itemsize == 8 else a.dtype))
        return a

    def down(a):
        if isinstance(a, tuple):
            return tuple(down(x) for x in a)
        return a if a is None or isinstance(a, (np.ndarray, int, float)) else dev.to_host(a)

    return call


@pytest.fixture
def both(backend):
    """``both(op)`` -> (the NumPy reference, the op on this test's backend)."""
    def get(name, writes=()):
        if not supports_op(name, backend):
            pytest.skip(f"{name} is not an op of {backend} (toolkit.ops.supports_op)")
        return get_op(name, "numpy"), on_backend(backend, get_op(name, backend), writes)

    return get
