"""MoQE Toolkit: a framework-free NumPy/Numba (and CUDA) runtime for MoE models with quantized experts.

The names below are imported on first use (PEP 562), so that ``import toolkit.cli`` loads neither NumPy's
kernels nor Numba: the CLI's own Ctrl-C handler is in place before anything slow is imported.
"""
from .errors import BackendError, FormatError, ModelError, ToolkitError

__version__ = "0.1.0"
__all__ = ["BackendError", "FORMATS", "Format", "FormatError", "ModelError", "QTensor", "ToolkitError",
           "available_backends", "get_format", "resolve_backend", "__version__"]
_LAZY = {"available_backends": ".backend", "resolve_backend": ".backend", "FORMATS": ".formats", "Format": ".formats",
         "QTensor": ".formats", "get_format": ".formats"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
