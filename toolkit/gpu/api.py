"""The CUDA backend (``cuda`` / ``cuda-emu``) as the model sees it: everything ``toolkit/model`` uses of
``toolkit/gpu`` goes through this module. Names load on first use: importing it imports neither CuPy nor the
launchers.

- ``ops_for(backend)``: the device's ops (``DeviceOps``: the op table, ``const``, the device as ``.dev``);
- ``upload_qtensor(dev, qt, role)``: a quantized weight's arrays on the device (repacked by role where the
  tensor-core GEMM reads another layout);
- ``Plan``: a recorded decode step, replayed (or captured as a CUDA graph) at each next token.
"""
from __future__ import annotations

from ..lazy import lazy_getattr

_WHERE = {"ops_for": ("ops", "ops_for"), "upload_qtensor": ("ops", "upload_qtensor"), "Plan": ("device", "Plan")}
__all__ = sorted(_WHERE)

__getattr__ = lazy_getattr(globals(), _WHERE)
