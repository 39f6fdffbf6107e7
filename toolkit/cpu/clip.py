"""clip on the CPU backends: the NumPy reference itself (toolkit/ref/clip.py), an elementwise step with no
faster Numba form. The CUDA kernel (cuda_src/clip.cu) is tested against this reference."""
from ..ref.clip import clip  # noqa: F401
