"""Serial and parallel builds of one kernel, picked per call by the amount of work.

A ``prange`` launch costs tens of microseconds (milliseconds on a busy 2-core machine), more than a
decode step's small ops take serially, so each op compiles its kernel both ways from the same source
and runs the parallel build only when the work is large enough to pay for the threads.
"""
from __future__ import annotations

import numba
from numba import njit

PARALLEL_MIN_WORK = 1 << 16  # elements (roughly flops / 2) below which the serial build runs


class Kernel:
    def __init__(self, fn, **flags):
        self.serial = njit(cache=True, **flags)(fn)
        self.parallel = njit(cache=True, parallel=True, **flags)(fn)

    def __call__(self, work: int, *args):
        if work >= PARALLEL_MIN_WORK and numba.get_num_threads() > 1:
            return self.parallel(*args)
        return self.serial(*args)


def kernel(**flags):
    """Decorator: ``@kernel()`` over a function written with ``prange``; call as ``k(work, *args)``."""
    return lambda fn: Kernel(fn, **flags)
