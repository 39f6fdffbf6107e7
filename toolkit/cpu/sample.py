"""sample on the CPU backends: the NumPy reference (toolkit/ref/sample.py), the specification of the CUDA
sampler (cuda_src/sample.cu: counter-based draws). CPU generation itself samples with
toolkit/model/sampling.py (NumPy's generator; greedy decoding is the same argmax on both)."""
from ..ref.sample import mark_seen, sample  # noqa: F401
