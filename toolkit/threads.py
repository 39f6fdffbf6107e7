"""Threads that never hurt: one setting for Numba's pool and the BLAS library, and BLAS kept to one thread for
the small products of a decode step.

Measured on this kind of 2-core machine with a second process busy: OpenBLAS on 2 threads took 12 ms for the
bundled model's LM head at one token (8192 x 256 f32, 8 MB), 0.34 ms on one thread: its workers spin and wait
for a CPU slice. So ``blas_for(work)`` gives BLAS the configured thread count only for products large enough
to pay for waking threads (prefill), and one thread otherwise; switching costs about 2 us (a direct call into
the library, found by threadpoolctl), and happens only when the count changes.

OpenBLAS's own workers spin too, for 2**28 cycles after each product, on the core the parallel expert GEMM right
after the attention's products needs: ``toolkit/__init__.py`` sets ``OPENBLAS_THREAD_TIMEOUT=4`` (2**4 cycles)
before NumPy loads OpenBLAS. Same run, 2 threads over 1 thread at prefill (64 tokens, q4_0 experts, int8
activations): 8 Qwen3-30B-A3B-shaped layers 1.27x -> 1.50x, one Mixtral layer 1.13x -> 1.49x.

``set_threads(n)`` (the CLI's and the app's ``--threads``) sets both pools; the default is every core Numba
sees. Numba kernels pick their serial or parallel build per call by work size (``toolkit/cpu/_jit.py``).
"""
from __future__ import annotations

import os

# Numba's OpenMP workers sleep between parallel regions instead of spinning (GNU OpenMP spins by default): a
# decode step alternates short parallel products with serial work, and on 2 cores a spinning worker takes the
# core the serial part needs. Qwen3-30B-A3B-shaped layers at 2 threads, same run: decode 13.1 -> 17.1 tok/s,
# prefill 31 -> 56 (1 thread: 16.4 / 41). Read when the OpenMP library loads (Numba's first parallel call),
# so it is set here, at import; a user's own OMP_WAIT_POLICY is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402

BLAS_MIN_WORK = 1 << 22  # multiply-adds from which a product gets the configured BLAS threads (~0.3 ms of work)


class _Blas:
    def __init__(self):
        self.controller = None
        self.current = None
        try:
            import numpy  # noqa: F401  (threadpoolctl finds the BLAS numpy loaded)
            from threadpoolctl import ThreadpoolController

            libs = ThreadpoolController().select(user_api="blas").lib_controllers
            self.controller = libs[0] if libs else None
        except ImportError:  # threadpoolctl missing: BLAS keeps its own setting
            pass

    def set(self, n: int) -> None:
        if self.controller is not None and n != self.current:
            self.controller.set_num_threads(n)
            self.current = n


_BLAS = _Blas()
_CONFIGURED = {"n": numba.config.NUMBA_NUM_THREADS}


def set_threads(n: int | None) -> int:
    """Use ``n`` threads (None: every core Numba sees) for Numba's parallel kernels and for large BLAS products."""
    limit = numba.config.NUMBA_NUM_THREADS
    n = limit if n is None else int(n)
    if not 1 <= n <= limit:
        from .errors import ToolkitError

        raise ToolkitError(f"threads must be between 1 and {limit} (the cores Numba sees), got {n}")
    numba.set_num_threads(n)
    _CONFIGURED["n"] = n
    _BLAS.set(n)
    return n


def threads() -> int:
    return _CONFIGURED["n"]


def blas_for(work: int) -> None:
    """Before a BLAS product of ``work`` multiply-adds: the configured threads when it is large, else one."""
    _BLAS.set(_CONFIGURED["n"] if work >= BLAS_MIN_WORK else 1)


def xwt(x, w):
    """``x [T, K] @ w [N, K].T`` -> C-contiguous ``[T, N]``, computed as ``(w @ x.T).T``: OpenBLAS then packs the
    small operand, not the weight (measured, 1 and 2 threads, 64 x 4096 @ 4096 x 4096: 20-30 % faster; 8 rows:
    16 -> 22 GFLOP/s; the same at 512 rows). Every dense f32 product with the weight as its right side goes here."""
    import numpy as np

    return np.ascontiguousarray((w @ x.T).T)
