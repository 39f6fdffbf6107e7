"""gated_add on the CPU backends: the NumPy reference itself (toolkit/ref/gated_add.py). A memory-bound gather or
elementwise step has no faster Numba form than NumPy's; the CPU runtime (toolkit/model/runtime.py) inlines
the same expressions in place. The CUDA kernel (cuda_src/gated_add.cu) is tested against this reference."""
from ..ref.gated_add import gated_add  # noqa: F401
