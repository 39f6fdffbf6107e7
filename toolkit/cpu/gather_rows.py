"""gather_rows on the CPU backends: the NumPy reference itself (toolkit/ref/gather_rows.py). A memory-bound gather or
elementwise step has no faster Numba form than NumPy's; the CPU runtime (toolkit/model/runtime.py) inlines
the same expressions in place. The CUDA kernel (cuda_src/gather_rows.cu) is tested against this reference."""
from ..ref.gather_rows import gather_rows  # noqa: F401
