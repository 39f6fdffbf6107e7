"""``python -m toolkit.bench formats``: quantize / dequantize throughput of every format, beside the
memory bandwidth measured in the same process, plus round-trip error on Gaussian weights.

GB/s counts bytes read plus bytes written (quantize: f32 in + stored out; dequantize: stored in + f32 out).
"""
from __future__ import annotations

import argparse

import numba
import numpy as np
from tqdm import tqdm

from ..formats import FORMATS, get_format
from .timing import median_seconds, memory_bandwidth, print_table, thread_counts


def specs() -> list[str]:
    out = []
    for f in FORMATS.values():
        out += [f"{f.name}-g{g}" for g in f.group_sizes] if f.group_sizes else [f.name]
    return out


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench formats", description=__doc__)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--backends", default="numba,numpy")
    ap.add_argument("--formats", default=",".join(specs()))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    w = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    threads = numba.config.NUMBA_NUM_THREADS
    bw = {t: memory_bandwidth(t, mib=512) for t in thread_counts()}
    print("memory bandwidth (streaming read, median): " + ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in bw.items()))
    rows = []
    for spec in tqdm(args.formats.split(","), desc="formats"):
        fmt = get_format(spec)
        for backend in args.backends.split(","):
            qt = fmt.quantize(w, backend)  # warm-up (JIT)
            tq = median_seconds(lambda: fmt.quantize(w, backend), reps=args.reps)
            td = median_seconds(lambda: qt.dequantize(backend), reps=args.reps)
            back = qt.dequantize(backend)
            rel_rmse = float(np.sqrt(np.mean((back - w) ** 2)) / np.sqrt(np.mean(w**2)))
            gq = (w.nbytes + qt.nbytes) / tq / 1e9
            view = any(np.shares_memory(back, a) for a in qt.arrays.values())  # f32 "dequantize" is a view
            gd = float("nan") if view else (qt.nbytes + w.nbytes) / td / 1e9
            rows.append({"format": spec, "backend": backend, "threads": threads,
                         "bits/weight": round(fmt.bits_per_weight(w.shape), 4), "rel RMSE": rel_rmse,
                         "quantize ms": tq * 1e3, "quantize GB/s": gq, "dequant ms": td * 1e3, "dequant GB/s": gd,
                         "dequant / bw": gd / bw[max(bw)]})
    print_table(rows, f"formats on a {args.rows}x{args.cols} f32 weight ({threads} threads; bandwidth {bw[max(bw)]:.1f} GB/s)")
    return rows
