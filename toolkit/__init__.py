"""MoQE Toolkit: a framework-free NumPy/Numba (and CUDA) runtime for MoE models with quantized experts.

The names below are imported on first use (PEP 562), so that ``import toolkit.cli`` loads neither NumPy's
kernels nor Numba: the CLI's own Ctrl-C handler is in place before anything slow is imported.
"""
import os as _os
import signal as _signal
import sys as _sys


def _interrupted(signum, frame):  # Ctrl-C while `moqe` is still importing: one line, exit 130, no traceback
    _os.write(2, b"moqe: interrupted\n")
    _os._exit(130)


# OpenBLAS's idle workers spin for 2**28 cycles (~0.1 s) after each product, on the cores the Numba kernels after
# it need; 2**4: they sleep at once (toolkit/threads.py says what it measured). OpenBLAS reads this when it loads,
# at NumPy's import: set here, before anything imports NumPy; a program that imported NumPy first sets it itself.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# One kernel cache for every entry point (the CLI, the app, the Python API, the tests): Numba reads
# NUMBA_CACHE_DIR when it is first imported; a program that imported Numba first gets the same folder here.
from . import paths as _paths  # noqa: E402

if not _os.environ.get("NUMBA_CACHE_DIR"):
    _os.environ["NUMBA_CACHE_DIR"] = _paths.cache_dir("numba")
    if "numba" in _sys.modules:
        _sys.modules["numba"].config.CACHE_DIR = _os.environ["NUMBA_CACHE_DIR"]

_CONSOLE = _os.path.basename(_sys.argv[0] if _sys.argv else "") == "moqe"  # run as the `moqe` console script
if _CONSOLE and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _interrupted)  # the console script; toolkit.cli.main puts Python's handler back

from .errors import BackendError, FormatError, ModelError, ToolkitError  # noqa: E402

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
