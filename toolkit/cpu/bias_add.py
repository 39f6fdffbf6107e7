"""bias_add on the CPU backends: the NumPy reference itself (toolkit/ref/bias_add.py). A memory-bound gather or
elementwise step has no faster Numba form than NumPy's; the CPU runtime (toolkit/model/runtime.py) inlines
the same expressions in place. The CUDA kernel (cuda_src/bias_add.cu) is tested against this reference."""
from ..ref.bias_add import bias_add  # noqa: F401
