"""CUDA backend: launchers for the kernels in ``cuda_src/<op>.cu`` (same stem as ``toolkit/ref/<op>.py``).

Each ``toolkit/gpu/<op>.py`` exports
- ``SOURCE`` (the .cu stem) and ``KERNELS`` (every kernel / template instantiation the launcher uses: the
  NVRTC name expressions, compiled by tests/test_cuda_compile.py for sm_80 and sm_90);
- ``check_<op>(...)``: the layout contract (dtype, contiguity, shapes), a pure function that raises
  :class:`~toolkit.errors.BackendError` naming the op and the broken condition;
- ``run_<op>(rt, ...)``: the launch plan, written once against a :class:`~toolkit.gpu.device.Device` ``rt``
  (``CupyDevice`` on a GPU, ``EmuDevice`` on the CPU through ``cuda_src/emu``): it uses ``rt.xp``,
  ``rt.launch`` and ``rt.arch`` (the checks are :mod:`toolkit.gpu.contract`'s), so the emulated tests run the
  launcher itself, on a device that proves it reads nothing back.
The backend's entry points are the methods of ``toolkit.gpu.ops.DeviceOps`` (what :func:`toolkit.ops.get_op`
returns for ``cuda`` / ``cuda-emu``), each one ``run_<op>`` on its device.
"""
from .source import CUDA_SRC

# every kernel source cuda_src/<stem>.cu, each with its launcher toolkit/gpu/<stem>.py (tests/test_cuda_compile.py
# compiles them all for sm_80 and sm_90); the ops they serve are toolkit.ops.OPS, found on this backend through
# toolkit.gpu.ops.DEVICE_OPS
CUDA_SOURCES = tuple(sorted(p.stem for p in CUDA_SRC.glob("*.cu")))
