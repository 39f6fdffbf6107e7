"""Serial and parallel builds of one kernel, picked per call by the amount of work.

A ``prange`` launch costs tens of microseconds (milliseconds on a busy 2-core machine), more than a
decode step's small ops take serially, so each op compiles its kernel both ways from the same source
and runs the parallel build only when the work is large enough to pay for the threads.
"""
from __future__ import annotations

import contextlib
import types

from numba import njit

from ..numba_cache import install as _lock_cache_index
from ..threads import _CONFIGURED as _THREADS

_lock_cache_index()

PARALLEL_MIN_WORK = 1 << 22  # elements (roughly flops / 2) below which the serial build runs: ~0.3-1 ms of work.
# A quiet machine's prange launch costs ~10 us, but on a shared one any launch waits for a CPU slice: with
# 1 << 18 the bundled model's decode (LM head 2 M, experts 0.3 M multiply-adds) ran slower on 2 threads than
# on 1 (bench anchors: 284 vs 462 tok/s). Decode steps of Mixtral-sized layers (~10^8) still split.


def twin(fn, suffix: str, **bindings):
    """A copy of ``fn`` under another qualified name, its global names ``bindings`` bound to other objects.

    Numba's on-disk cache keys an entry by the function's qualified name, signature, bytecode and closure,
    not by its compile flags or its globals: two builds of one function (serial and parallel, or one per
    format) must carry different names, or they overwrite and load each other's machine code. Binding a
    global (a format's row decoder) instead of a closure keeps the cache key stable across processes.
    """
    glb = {**fn.__globals__, **bindings} if bindings else fn.__globals__
    t = types.FunctionType(fn.__code__, glb, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    t.__qualname__, t.__module__, t.__doc__ = fn.__qualname__ + suffix, fn.__module__, fn.__doc__
    return t


def with_item(outer, item, suffix: str, flags: dict, cache: bool = True, **bindings) -> tuple:
    """(``outer`` bound to ``ITEM``, the ``ITEM`` dispatcher): ``item``, the body of ``outer``'s ``prange`` loop
    (called as ``ITEM(np.int64(i), ...)``: one signature), compiled once as its own function with ``flags`` and
    ``bindings``. The serial and the parallel build of ``outer`` both call it: inlined, the body was compiled twice,
    and the parallel build's parfor passes over it took ~3x the serial build's time."""
    it = njit(cache=cache, nogil=True, **flags)(twin(item, suffix, **bindings))
    return twin(outer, suffix, ITEM=it, **bindings), it


class Kernel:
    """Serial and parallel builds of ``fn`` (a plain Python function written with ``prange``), each compiled
    on its first call and cached on disk under its own name."""

    def __init__(self, fn, **flags):
        flags.setdefault("nogil", True)  # the server's event loop (and any other Python thread) runs meanwhile
        self.serial = njit(cache=True, **flags)(fn)
        self.parallel = njit(cache=True, parallel=True, **flags)(twin(fn, "__parallel"))

    def __call__(self, work: int, *args):
        if work >= PARALLEL_MIN_WORK and _THREADS["n"] > 1:  # the configured count (numba.get_num_threads
            return self.parallel(*args)                       # costs ~30 us a call on a busy machine)
        return self.serial(*args)


@contextlib.contextmanager
def parallel_threshold(work: int):
    """``with parallel_threshold(0): ...``: every kernel called inside picks its build by ``work`` as the
    threshold (0: the parallel builds, ``1 << 62``: the serial ones); the default is restored after."""
    global PARALLEL_MIN_WORK
    saved, PARALLEL_MIN_WORK = PARALLEL_MIN_WORK, work
    try:
        yield
    finally:
        PARALLEL_MIN_WORK = saved


def kernel(**flags):
    """Decorator: ``@kernel()`` over a function written with ``prange``; call as ``k(work, *args)``."""
    return lambda fn: Kernel(fn, **flags)


def signature(args) -> tuple:
    """The Numba argument types ``args`` compile under (what a dispatcher's overloads and disk cache are keyed by)."""
    from numba import typeof

    return tuple(typeof(a) for a in args)


def ready(dispatcher, args, compile: bool) -> bool:
    """Whether ``dispatcher`` has machine code for ``args``' types: already in this process, or loaded now from
    Numba's disk cache; with ``compile``, compiled now if neither. Without it nothing is compiled (a caller
    keeps a slower path rather than pay a cold compile in the middle of a run)."""
    return ready_sig(dispatcher, signature(args), compile)


def ready_sig(dispatcher, sig: tuple, compile: bool) -> bool:
    """``ready`` for argument types ``sig`` (``signature``)."""
    if sig in dispatcher.overloads:
        return True
    if compile:
        dispatcher.compile(sig)
        return True
    from numba.core.compiler_lock import global_compiler_lock

    try:  # Dispatcher.compile's own disk-cache step, without its fallback to compiling
        with global_compiler_lock:
            cres = dispatcher._cache.load_overload(sig, dispatcher.targetctx)
            if cres is None:
                return False
            dispatcher.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
            dispatcher.add_overload(cres)
    except AttributeError:  # a Numba without these internals: treat as not cached
        return False
    return True
