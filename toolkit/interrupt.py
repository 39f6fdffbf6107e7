"""Ctrl-C in a ``moqe`` command: a KeyboardInterrupt only where Python code can unwind cleanly.

- While Numba holds its compiler lock (compiling a kernel, or loading its machine code from the disk cache)
  a Ctrl-C is deferred to the moment the lock is released. Raised inside, it can land in llvmlite's
  callbacks from C, which swallow it ("Exception ignored on calling ctypes callback function") and leave the
  compile broken: the command then failed later with an unrelated error, or not at all.
- One that a callback from C swallows all the same is noted (:data:`INTERRUPTED`) and raised again in the
  main thread a moment later (``sys.unraisablehook``).

``with handling():`` around a command installs both and puts back what was there before.
"""
from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading

INTERRUPTED = threading.Event()  # a Ctrl-C was swallowed by a callback from C during this command
_STATE = {"depth": 0, "pending": False}  # the main thread's depth in Numba's compiler lock; a deferred Ctrl-C


def _handler(signum, frame):
    if _STATE["depth"] > 0:  # inside Numba's compiler: raised when it lets go (_Lock.on_end)
        _STATE["pending"] = True
        return
    raise KeyboardInterrupt


def _lock_listener():
    from numba.core import event

    class _Lock(event.Listener):
        def on_start(self, e):
            if threading.current_thread() is threading.main_thread():
                _STATE["depth"] += 1

        def on_end(self, e):
            if threading.current_thread() is threading.main_thread():
                _STATE["depth"] = max(0, _STATE["depth"] - 1)
                if _STATE["depth"] == 0 and _STATE["pending"]:
                    _STATE["pending"] = False
                    _thread.interrupt_main()  # our handler runs at the next bytecode, outside the lock

    return event, _Lock()


@contextlib.contextmanager
def handling():
    """Ctrl-C as above for the duration of one command (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved_hook, saved_handler = sys.unraisablehook, signal.getsignal(signal.SIGINT)
    INTERRUPTED.clear()
    _STATE.update(depth=0, pending=False)

    def unraisable(u):
        if isinstance(u.exc_value, KeyboardInterrupt):
            INTERRUPTED.set()
            threading.Timer(0.01, _thread.interrupt_main).start()
        else:
            saved_hook(u)

    event, listener = _lock_listener()  # imports Numba (every command but `formats` uses it anyway)
    event.register("numba:compiler_lock", listener)
    sys.unraisablehook = unraisable
    if saved_handler is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, saved_handler if saved_handler is not None else signal.default_int_handler)
        sys.unraisablehook = saved_hook
        event.unregister("numba:compiler_lock", listener)
