"""Serial and parallel builds of one kernel, picked per call by the amount of work.

A ``prange`` launch costs tens of microseconds (milliseconds on a busy 2-core machine), more than a
decode step's small ops take serially, so each op compiles its kernel both ways from the same source
and runs the parallel build only when the work is large enough to pay for the threads.
"""
from __future__ import annotations

import types

import numba
from numba import njit

PARALLEL_MIN_WORK = 1 << 16  # elements (roughly flops / 2) below which the serial build runs


def _twin(fn, suffix: str):
    """A copy of ``fn`` under another qualified name. Numba's on-disk cache keys an entry by the function's
    name, signature and bytecode, not by its compile flags: two builds of one function would overwrite
    and load each other's machine code (a "serial" build running the parallel code, or the reverse)."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    twin.__qualname__, twin.__module__, twin.__doc__ = fn.__qualname__ + suffix, fn.__module__, fn.__doc__
    return twin


class Kernel:
    def __init__(self, fn, **flags):
        self.serial = njit(cache=True, **flags)(fn)
        self.parallel = njit(cache=True, parallel=True, **flags)(_twin(fn, "__parallel"))

    def __call__(self, work: int, *args):
        if work >= PARALLEL_MIN_WORK and numba.get_num_threads() > 1:
            return self.parallel(*args)
        return self.serial(*args)


def kernel(**flags):
    """Decorator: ``@kernel()`` over a function written with ``prange``; call as ``k(work, *args)``."""
    return lambda fn: Kernel(fn, **flags)
