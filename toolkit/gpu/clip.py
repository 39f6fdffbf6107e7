"""cuda clip: launcher of ``cuda_src/clip.cu``, in place ``x f32 [...]`` clamped to ``[-c, c]`` (flattened)."""
from __future__ import annotations

import numpy as np

from ..errors import BackendError
from .contract import check_array

SOURCE = "clip"
KERNELS = ("clip_kernel",)
THREADS = 256


def check_clip(x, c) -> None:
    check_array("clip", "x", x, np.float32)
    if not c > 0:
        raise BackendError(f"clip: the bound c must be positive, got {c!r}")


def run_clip(rt, x, c) -> None:
    check_clip(x, c)
    n = x.size
    if n:
        rt.launch(SOURCE, "clip_kernel", (-(-n // THREADS),), (THREADS,), (x, np.float32(c), np.int64(n)))
