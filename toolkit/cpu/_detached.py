"""Compile kernels in a detached fork of this process, on the other core: ``start_detached(job)``.

Numba compiles on one thread, so a run on a cold kernel cache leaves a core idle while it compiles. Two users
(``toolkit/model/coldstart.py``): a cold ``moqe generate`` forks a helper right after its model is loaded,
which compiles the kernels the run needs later (the experts' side, the LM head) while the run compiles the
attention's, then the compiled decode step for the next runs; a warm run that finds its decode step missing
hands that build to one at its end (``compile_detached``).

The fork (Linux only) shares the loaded model's pages copy-on-write and needs nothing re-imported or
re-loaded. It is double-forked into its own session (no zombie, no terminal signals), with stdin / stdout /
stderr on ``/dev/null`` and every other descriptor closed (a caller reading this process's pipes is not held
open by it), at a lower priority, and leaves with ``os._exit``. Numba saves what it compiles to the disk
cache (``toolkit/numba_cache.py`` keeps two processes' saves of one function), where the run finds it at the
kernel's first call. One such process runs at a time per cache folder: an exclusive ``flock`` on
``decode-build.lock`` that the grandchild holds until it exits; a run that finds the lock held starts none.
"""
from __future__ import annotations

import os
import sys

LOCK = "decode-build.lock"
LIMIT_S = 900  # seconds a detached process may run


def _supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def start_detached(job, lock_dir: str | None = None) -> tuple[str, int | None]:
    """Run ``job()`` in a detached fork of this process (see the module docstring), holding the cache folder's
    build lock. Returns ("started", pid), ("busy", None) when another build holds the lock, or
    ("unsupported", None) off Linux."""
    if not _supported():
        return "unsupported", None
    import fcntl
    import warnings

    from ..paths import kernel_cache

    path = os.path.join(lock_dir or kernel_cache(), LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return "busy", None
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()  # the grandchild's pid, back to this process
    with warnings.catch_warnings():  # Python 3.12 warns of fork() with threads alive (Numba's pool, tqdm's
        warnings.simplefilter("ignore", DeprecationWarning)  # monitor): the fork runs only serial builds
        pid = os.fork()
    if pid == 0:  # child: fork the grandchild and leave at once (the caller reaps us: no zombie)
        try:
            os.setsid()
            if os.fork() == 0:
                os.close(r)
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                _detach(keep=fd)
                try:
                    job()
                except BaseException:  # noqa: BLE001 (nothing to report to: the next run compiles what is missing)
                    pass
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    os.close(fd)  # the grandchild keeps its own copy of the locked descriptor until it exits
    return "started", int(got) if got else None


def compile_detached(builds, lock_dir: str | None = None) -> tuple[str, int | None]:
    """Compile ``builds`` [(dispatcher, signature)] in a detached process (``start_detached``); ("nothing", None)
    for no builds."""
    if not builds:
        return "nothing", None

    def job():
        for dispatcher, sig in builds:
            try:
                dispatcher.compile(sig)  # saved to the disk cache
            except Exception:  # noqa: BLE001 (one that fails is left to the next run)
                pass

    return start_detached(job, lock_dir)


def wait_done(lock_dir: str | None = None, limit_s: float = 300.0) -> bool:
    """Wait until no background build of that cache folder runs (its lock is free); False after ``limit_s``."""
    import fcntl
    import time

    from ..paths import kernel_cache

    path = os.path.join(lock_dir or kernel_cache(), LOCK)
    t0 = time.monotonic()
    while os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() - t0 > limit_s:
                return False
        finally:
            os.close(fd)
        time.sleep(0.2)
    return True


def _detach(keep: int) -> None:
    """The grandchild: stdin / stdout / stderr on /dev/null, every other descriptor but ``keep`` closed, low priority."""
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    try:
        os.nice(10)
    except OSError:
        pass
    import signal

    signal.alarm(LIMIT_S)  # a helper that hangs is ended (SIGALRM's default) and frees the lock
