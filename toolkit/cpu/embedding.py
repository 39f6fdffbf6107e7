"""embedding on the CPU backends: the NumPy reference itself (toolkit/ref/embedding.py). A memory-bound gather or
elementwise step has no faster Numba form than NumPy's; the CPU runtime (toolkit/model/runtime.py) inlines
the same expressions in place. The CUDA kernel (cuda_src/embedding.cu) is tested against this reference."""
from ..ref.embedding import embedding  # noqa: F401
