"""Timing and memory-bandwidth helpers shared by the benchmarks (medians, threads, conditions, tables)."""
from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from typing import Callable

import numba
import numpy as np
from numba import njit, prange

from ..mapped import resident


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


# ---- the streaming-read probe ------------------------------------------------------------------------------
# Every "fraction of bandwidth" the benches print is against this probe, so it must read at least as fast
# as the fastest real reader of the same bytes (torch's f32 GEMV, checked in tests/test_bench_probe.py).
# One thread sums one contiguous chunk. Inside it, the chunk is read as STREAMS contiguous sub-slices in
# lockstep: one sequential stream on one core is limited by how far ahead the L2 streamer prefetches a
# single stream, several streams keep more cache lines in flight (a GEMV reads several rows at once too).
# The loops index 0-based slices with ``range(len)``, so LLVM sees non-negative indices: no wraparound
# fix-ups, no gathers or scalar inserts, only packed vector adds over the loads (checked on the assembly),
# with enough independent accumulators that the adds never limit it (about 50 GB/s from L2 on one core).
STREAMS = 8


@njit(cache=True, fastmath=True, boundscheck=False)
def _sum_chunk(a, lo, hi):  # a [n] f32, [lo, hi) -> f32: reads a[lo:hi] once
    m = (hi - lo) // STREAMS
    s0 = a[lo: lo + m]
    s1 = a[lo + m: lo + 2 * m]
    s2 = a[lo + 2 * m: lo + 3 * m]
    s3 = a[lo + 3 * m: lo + 4 * m]
    s4 = a[lo + 4 * m: lo + 5 * m]
    s5 = a[lo + 5 * m: lo + 6 * m]
    s6 = a[lo + 6 * m: lo + 7 * m]
    s7 = a[lo + 7 * m: lo + 8 * m]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(m):  # one accumulator per stream: LLVM keeps 2 vector registers each (16 independent chains)
        a0 += s0[i]
        a1 += s1[i]
        a2 += s2[i]
        a3 += s3[i]
        a4 += s4[i]
        a5 += s5[i]
        a6 += s6[i]
        a7 += s7[i]
    acc = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    tail = a[lo + STREAMS * m: hi]
    for i in range(tail.shape[0]):
        acc += tail[i]
    return acc


@njit(cache=True, parallel=True, fastmath=True, boundscheck=False)
def _sum_threads(a, nt):  # one contiguous chunk (4 KiB-aligned) per thread, each summed by _sum_chunk
    n = a.shape[0]
    step = ((n + nt - 1) // nt + 1023) // 1024 * 1024
    partial = np.zeros(nt, np.float32)
    for t in prange(nt):
        lo = min(n, t * step)
        partial[t] = _sum_chunk(a, lo, min(n, lo + step))
    return partial.sum()


def stream_read(a: np.ndarray, threads: int) -> float:
    """Sum of the f32 vector ``a`` read once: serially on 1 thread, else one chunk per Numba thread."""
    if threads <= 1:
        return float(_sum_chunk(a, 0, a.shape[0]))
    old = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        return float(_sum_threads(a, threads))
    finally:
        numba.set_num_threads(old)


def probe_array(mib: int = 512) -> np.ndarray:
    return np.ones(mib * (1 << 20) // 4, np.float32)  # written once, so every page is mapped before timing


def memory_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Streaming-read bandwidth in GB/s (1e9 bytes/s) on ``threads`` threads, median of ``reps`` passes."""
    a = probe_array(mib)
    t = median_seconds(lambda: stream_read(a, threads), reps=reps, warmup=1)
    return a.nbytes / t / 1e9


def bandwidth_line(bw: dict[int, float]) -> str:
    return ("memory bandwidth (streaming-read probe, median; machine may be shared): "
            + ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in bw.items()))


def torch_gemv_f32(n: int = 28672, k: int = 4096):
    """(call, bytes): torch ``F.linear`` of a 1-token f32 activation with an [n, k] f32 weight (Mixtral's
    gate_up at the default shape), the reference reader the probe must keep up with. None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    w = torch.randn(n, k) * 0.02
    x = torch.randn(1, k)
    return (lambda: F.linear(x, w)), w.numel() * 4


def probe_vs_torch(rounds: int = 7, mib: int = 512, threads: int = 1) -> dict | None:
    """Probe and torch's f32 GEMV timed alternately (``rounds`` pairs, ``threads`` threads for both), so that
    both see the same load. Returns GB/s medians and the median of the per-round ratios; None without torch."""
    g = torch_gemv_f32()
    if g is None:
        return None
    gemv, gemv_bytes = g
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = probe_array(mib)
    try:
        stream_read(a, threads), gemv()  # warm-up (JIT, torch's first call)
        probe, ref, ratio = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            stream_read(a, threads)
            t1 = time.perf_counter()
            gemv()
            t2 = time.perf_counter()
            probe.append(a.nbytes / (t1 - t0) / 1e9)
            ref.append(gemv_bytes / (t2 - t1) / 1e9)
            ratio.append(probe[-1] / ref[-1])
    finally:
        torch.set_num_threads(old)
    return {"threads": threads, "probe GB/s": statistics.median(probe), "torch f32 GEMV GB/s": statistics.median(ref),
            "probe/torch": statistics.median(ratio), "rounds": rounds}


# ---- threads and conditions ----------------------------------------------------------------------------------
def thread_counts() -> list[int]:
    n = numba.config.NUMBA_NUM_THREADS
    return [1] if n == 1 else [1, n]


def set_threads(n: int) -> None:
    """The runtime's one setting (Numba's pool and BLAS: ``toolkit/threads.py``), plus torch's when imported."""
    import sys

    from ..threads import set_threads as set_runtime_threads

    set_runtime_threads(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def isa() -> str:
    """The widest x86 vector ISA of this host from /proc/cpuinfo: 'AVX-512' (+VNNI) or 'AVX2' (else the arch)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if "avx512f" in flags:
        return "AVX-512" + (" (VNNI)" if "avx512_vnni" in flags else "")
    if "avx2" in flags:
        return "AVX2" + (" (AVX-VNNI)" if "avx_vnni" in flags else "")
    import platform
    return platform.machine() or "unknown"


def conditions(threads: list[int] | None = None) -> str:
    """One line on the run's conditions: cores, ISA, thread counts, load average now."""
    load = os.getloadavg()
    cores = os.cpu_count()
    t = ",".join(map(str, threads or thread_counts()))
    return (f"conditions: {cores} cores, {isa()}, threads {t}, load average {load[0]:.2f} / {load[1]:.2f} / "
            f"{load[2]:.2f} (1/5/15 min; above 0 the machine is shared, compare ratios within this run)")


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
    if v is None:
        return "-"
    return str(v)


def peak_of(cmd: list[str], timeout: float = 1800, env=None) -> tuple[int, str, str, int]:
    """Run ``cmd``: (exit status, stdout, stderr, its peak resident bytes). The peak is the program's own
    ``VmHWM``, read from ``/proc/PID/status`` every 10 ms while it runs (a high-water mark: the last reading
    holds every earlier peak). Not ``wait4``'s ``ru_maxrss``: the child is started by vfork and shares the
    parent's memory until it execs, and the kernel folds that into ru_maxrss: a bench process holding 17 GB
    made a 5 GB llama-bench read as 17 GB."""
    with open(os.devnull, "rb") as null, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdin=null, stdout=out, stderr=err, env=env)
        t_end, peak = time.monotonic() + timeout, 0
        while p.poll() is None:
            peak = max(peak, resident(p.pid)["peak"])
            if time.monotonic() > t_end:
                p.kill()
                p.wait()
                break
            time.sleep(0.01)
        out.seek(0), err.seek(0)
        return p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), peak


class RowStream:
    """A table printed one row per line, flushed, as each row is measured (and, with ``path``, appended to a TSV
    file the same way): a run cut short by a time limit keeps every row it finished. ``rows`` holds them all."""

    def __init__(self, title: str, path: str | None = None):
        from ..writes import check_append_target

        self.title, self.path, self.rows, self.keys = title, path, [], None
        if path:
            check_append_target(path)  # the write rule for appended rows: a regular file (or none yet)

    def add(self, row: dict) -> dict:
        if self.keys is None:
            self.keys = list(row)
            print(f"\n{self.title}\n| " + " | ".join(self.keys) + " |\n|" + "---|" * len(self.keys), flush=True)
            self._write(self.keys)
        print("| " + " | ".join(_fmt(row.get(k)) for k in self.keys) + " |", flush=True)
        self._write([f"{v:.6g}" if isinstance(v, float) else "-" if v is None else str(v)
                     for v in (row.get(k) for k in self.keys)])
        self.rows.append(row)
        return row

    def _write(self, cells: list[str]) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write("\t".join(cells) + "\n")
