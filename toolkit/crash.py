"""Unexpected errors at the edge (CLI, app): one line for the user, the full report in a file.

``report(exc, context)`` writes the traceback, the command or request and the versions to
``$MOQE_CRASH_DIR`` (default ``~/.cache/moqe/crash``, or the temporary folder when that is not writable)
and returns the path, which the one-line message names.
"""
from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path


def one_line(text: str, limit: int = 600) -> str:
    """A message on one line (newlines folded), cut to ``limit`` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _crash_dirs() -> list[Path]:
    from .paths import cache_dir

    env = os.environ.get("MOQE_CRASH_DIR")
    return [Path(env)] if env else [Path(cache_dir("crash", create=False)), Path(tempfile.gettempdir()) / "moqe-crash"]


def report(exc: BaseException, context: str) -> Path | None:
    """Write a crash report for ``exc``; returns its path (None when no folder was writable)."""
    import numpy

    body = [f"moqe-toolkit crash report, {time.strftime('%Y-%m-%d %H:%M:%S')}", f"context: {context}",
            f"python {sys.version.split()[0]} on {platform.platform()}, numpy {numpy.__version__}", "",
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
    name = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for d in _crash_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            path = d / name
            path.write_text("\n".join(body))
            return path
        except OSError:
            continue
    return None
