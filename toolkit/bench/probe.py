"""``python -m toolkit.bench probe``: the streaming-read probe (``timing.memory_bandwidth``) against torch's f32
GEMV in the same run, alternating passes (both see the same load), per thread count.

Every "fraction of bandwidth" the benches print divides by the probe, so a probe slower than torch's GEMV
flatters every kernel by ``1 / (probe/torch)``. This is a measurement, not a unit test (a timed assertion fails
on a shared machine for reasons that are not the code's): the unit tests check the probe's loop and sums.

    python -m toolkit.bench probe [--rounds 21] [--mib 512] [--threads 1,2]
"""
from __future__ import annotations

import argparse

from .timing import print_table, probe_vs_torch, thread_counts


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench probe")
    ap.add_argument("--rounds", type=int, default=21, help="alternating pairs of passes (default %(default)s)")
    ap.add_argument("--mib", type=int, default=512, help="MiB read per pass (default %(default)s)")
    ap.add_argument("--threads", default=None, metavar="LIST", help="thread counts (default: 1 and every core)")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else thread_counts()
    rows = []
    for t in threads:
        r = probe_vs_torch(rounds=args.rounds, mib=args.mib, threads=t)
        if r is None:
            print("torch is not installed: nothing to compare the probe with")
            return []
        rows.append({**r, "benches' bandwidth fractions overstated by": max(0.0, 1 / r["probe/torch"] - 1)})
    print_table(rows, "the bandwidth probe against torch's f32 GEMV (medians of alternating passes)")
    return rows
