"""Timing and memory-bandwidth helpers shared by the benchmarks (medians, threads, tables)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import numba
import numpy as np
from numba import njit, prange


def median_seconds(fn: Callable[[], object], reps: int = 5, warmup: int = 1, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after ``warmup`` runs (more reps if under min_time)."""
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return statistics.median(times)


@njit(cache=True, parallel=True, fastmath=True)
def _stream_sum(a):  # a [n] f32 -> f32: reads every byte once, in order (fastmath lets LLVM vectorise the sum)
    chunks = 64
    step = (a.shape[0] + chunks - 1) // chunks
    partial = np.zeros(chunks, np.float32)
    for c in prange(chunks):
        acc = np.float32(0.0)
        for i in range(c * step, min(a.shape[0], (c + 1) * step)):
            acc += a[i]
        partial[c] = acc
    return partial.sum()


def memory_bandwidth(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """Streaming-read bandwidth in GB/s (1e9 bytes/s) on ``threads`` threads, median of ``reps`` passes."""
    a = np.ones(mib * (1 << 20) // 4, np.float32)
    old = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        t = median_seconds(lambda: _stream_sum(a), reps=reps, warmup=1)
    finally:
        numba.set_num_threads(old)
    return a.nbytes / t / 1e9


def thread_counts() -> list[int]:
    n = numba.config.NUMBA_NUM_THREADS
    return [1] if n == 1 else [1, n]


def print_table(rows: list[dict], title: str = "") -> str:
    """Render rows (dicts with the same keys) as a GitHub-style markdown table; prints and returns it."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = [f"\n{title}" if title else ""]
    lines.append("| " + " | ".join(k.ljust(w) for k, w in zip(keys, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)
