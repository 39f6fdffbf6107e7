"""nll on the CPU backends: the NumPy reference (toolkit/ref/nll.py). CPU perplexity computes the same
log-softmax in float64 inline (toolkit/model/generate.py); the CUDA kernel (cuda_src/nll.cu) is tested
against this reference."""
from ..ref.nll import nll  # noqa: F401
