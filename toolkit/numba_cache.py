"""Numba's disk cache shared safely by processes that compile at the same time.

Numba keeps one index file per source function (``<name>.nbi``: signature -> data file) and updates it by
read, add, rewrite. Two processes that save an entry of the same function at the same moment both read the
old index, and the last to write drops the other's entry (``moqe warmup --jobs N``'s workers, pytest's workers,
the app and a CLI run side by side): the lost kernel then compiles again in the next process. ``install()``
makes that update hold an exclusive ``flock`` on ``<name>.nbi.lock``, so each writer reads the index the one
before it wrote. Reads need no lock: Numba replaces an index file whole (write a temporary, then rename).
Called by ``toolkit/cpu/_jit.py`` at import: every kernel module (``toolkit/cpu``, ``toolkit/formats``)
imports it before it defines a kernel, so the lock is in place before anything compiles.
"""
from __future__ import annotations

import contextlib
import os

_INSTALLED = False


@contextlib.contextmanager
def _locked(path: str):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): Numba's own behaviour
        yield
        return
    try:
        fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:  # a read-only cache folder: Numba reports that itself
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def install() -> bool:
    """Wrap ``IndexDataCacheFile.save`` (once per process) -> whether it is wrapped (False: a Numba without it)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from numba.core.caching import IndexDataCacheFile
    except ImportError:
        return False
    save = IndexDataCacheFile.save
    if not (hasattr(IndexDataCacheFile, "_load_index") and hasattr(IndexDataCacheFile, "_save_index")):
        return False  # another design of the index: leave it as it is

    def locked_save(self, key, data):
        with _locked(self._index_path):
            return save(self, key, data)

    locked_save.__wrapped__ = save
    IndexDataCacheFile.save = locked_save
    _INSTALLED = True
    return True
