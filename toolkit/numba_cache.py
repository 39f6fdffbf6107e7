"""Numba's disk cache shared safely by processes that compile at the same time.

Numba keeps one index file per source function (``<name>.nbi``: signature -> data file) and updates it by
read, add, rewrite. Two processes that save an entry of the same function at the same moment both read the
old index, and the last to write drops the other's entry (``moqe warmup --jobs N``'s workers, pytest's workers,
the app and a CLI run side by side): the lost kernel then compiles again in the next process. ``install()``
makes that update hold an exclusive ``flock`` on ``<name>.nbi.lock``, so each writer reads the index the one
before it wrote. Reads need no lock: Numba replaces an index file whole (write a temporary, then rename).
Called by ``toolkit/cpu/_jit.py`` at import: every kernel module (``toolkit/cpu``, ``toolkit/formats``)
imports it before it defines a kernel, so the lock is in place before anything compiles.

Numba also checks an entry against its own source file only (a hash of it), but a compiled function carries the
machine code of every jitted function it calls: a cached decode step built over ``gemv.py``'s kernels kept the old
ones after ``gemv.py`` alone changed (an editable install after ``git pull``, a packing change: wrong bits, not
only old speed). ``install()`` therefore also stamps every entry of a function defined under ``toolkit/`` with
``sources_stamp()``, a hash of every kernel source of the package (the ``.py`` files that mention Numba or the
``_jit`` helpers), so an edit to any of them makes the toolkit's entries stale and they compile again, once.
Not covered: a constant a kernel reads from a module that holds no kernel (Numba freezes global values).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re

_INSTALLED = False
ROOT = os.path.dirname(os.path.abspath(__file__))  # toolkit/
_KERNEL_SOURCE = re.compile(rb"numba|_jit\b")


def kernel_sources(root: str = ROOT) -> list[str]:
    """The ``.py`` files under ``root`` that may hold jitted code (they mention Numba or ``_jit``), sorted."""
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, "rb") as fh:
                    if _KERNEL_SOURCE.search(fh.read()):
                        found.append(path)
    return found


def sources_stamp(root: str = ROOT) -> str:
    """A hash of the kernel sources under ``root``: their paths relative to it and their bytes."""
    h = hashlib.blake2b(digest_size=16)
    for path in kernel_sources(root):
        with open(path, "rb") as fh:
            body = fh.read()
        h.update(os.path.relpath(path, root).encode() + b"\0" + str(len(body)).encode() + b"\0" + body)
    return h.hexdigest()


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


def _stamp_package(Cache, root: str) -> None:
    """Every cache of a function defined under ``root`` gets ``(its own stamp, sources_stamp(root))``."""
    init, stamp, prefix = Cache.__init__, sources_stamp(root), os.path.join(root, "")

    def stamped_init(self, py_func, *args, **kwargs):
        init(self, py_func, *args, **kwargs)
        f = getattr(self, "_cache_file", None)
        mine = os.path.abspath(py_func.__code__.co_filename).startswith(prefix)
        if mine and f is not None and hasattr(f, "_source_stamp"):
            f._source_stamp = (f._source_stamp, stamp)

    stamped_init.__wrapped__ = init
    Cache.__init__ = stamped_init


def install(root: str = ROOT) -> bool:
    """Wrap ``IndexDataCacheFile.save`` and stamp the entries of the functions under ``root`` (once per process)
    -> whether it is done (False: a Numba whose cache is built otherwise, left as it is)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from numba.core.caching import Cache, IndexDataCacheFile
    except ImportError:
        return False
    save = IndexDataCacheFile.save
    if not (hasattr(IndexDataCacheFile, "_load_index") and hasattr(IndexDataCacheFile, "_save_index")):
        return False  # another design of the index: leave it as it is
    _stamp_package(Cache, root)

    def locked_save(self, key, data):
        with _locked(self._index_path):
            return save(self, key, data)

    locked_save.__wrapped__ = save
    IndexDataCacheFile.save = locked_save
    _INSTALLED = True
    return True
