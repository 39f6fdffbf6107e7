"""Where the toolkit keeps what it makes for itself: one per-user cache folder for every entry point.

``cache_dir(part)`` is ``$MOQE_CACHE_DIR/part``, by default ``$XDG_CACHE_HOME/moqe/part`` (``~/.cache/moqe/part``);
when that cannot be made (a read-only home), a folder of the user's own under the temporary folder. The parts:
``numba`` (Numba's compiled kernels: ``NUMBA_CACHE_DIR`` is set to it when ``toolkit`` is imported, unless the
user set it), ``cuda-emu`` (the emulator's builds, ``$MOQE_EMU_CACHE`` wins) and ``crash`` (crash reports).
So the CLI, the app, the Python API and the tests share one kernel cache, and nothing compiles twice on one
machine. Standard library only: ``toolkit/__init__.py`` calls it before anything imports Numba.
"""
from __future__ import annotations

import os
import tempfile


def cache_root() -> str:
    env = os.environ.get("MOQE_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moqe")


def cache_dir(part: str, create: bool = True) -> str:
    """The cache folder ``part``; made when ``create`` (its fallback under the temporary folder if it cannot be)."""
    d = os.path.join(cache_root(), part)
    if not create:
        return d
    try:
        os.makedirs(d, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = os.path.join(tempfile.gettempdir(), f"moqe-{os.getuid() if hasattr(os, 'getuid') else 'user'}", part)
    os.makedirs(d, exist_ok=True)
    return d


def kernel_cache() -> str:
    """Numba's cache folder in use: ``NUMBA_CACHE_DIR`` (set by ``toolkit``'s import when the user did not)."""
    return os.environ.get("NUMBA_CACHE_DIR") or cache_dir("numba")
