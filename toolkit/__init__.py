"""MoQE Toolkit: a framework-free NumPy/Numba (and CUDA) runtime for MoE models with quantized experts."""
from .backend import available_backends, resolve_backend
from .errors import BackendError, FormatError, ModelError, ToolkitError
from .formats import FORMATS, Format, QTensor, get_format

__version__ = "0.1.0"
__all__ = ["BackendError", "FORMATS", "Format", "FormatError", "ModelError", "QTensor", "ToolkitError",
           "available_backends", "get_format", "resolve_backend", "__version__"]
