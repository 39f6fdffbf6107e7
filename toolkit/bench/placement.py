"""``python -m toolkit.bench placement``: routed experts on the host behind a device, at one token (decode).

One MoE layer of a real shape (default Mixtral's: D 4096, I 14336, E 8, top-2) with every routed expert on the
host (``--cpu-moe``), run the way a hybrid model runs it: the routing and the hidden row on the emulated device
(``cuda-emu``: its every copy counted), ``hybrid_experts`` copying out what the host needs, the Numba kernels
running the host group, the output copied back and added on the device. Against the standalone Numba
``fused_moe`` on the same experts and token (what the host alone would do): the split's overhead. Also printed:
the bytes across the bus per token against ``layer_bus_bytes``, and the host group's GB/s against the memory
bandwidth measured in this process. The whole hybrid call is shown too: on the emulated device its glue (the
gather, the add, the copies) runs the CUDA kernels' CPU emulation, slower than a GPU's launches; the host group's
time is taken inside the call (``experts.host_s``). Interleaved rounds, medians.

    python -m toolkit.bench placement [--experts q4_0] [--reps 7] [--threads 1,2] [--backend cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from .timing import bandwidth_line, memory_bandwidth, print_table, set_threads, thread_counts


def _layer(fmt: str, D: int, I: int, E: int, seed: int = 0):
    """``gate_up [E, 2I, D]``, ``down [E, D, I]`` QTensors of ``fmt`` (one expert quantized, its arrays tiled:
    distinct memory, the same bytes), and the router ``[E, D]``."""
    from ..quant.joint import _tiled
    from ..formats import get_format

    rng = np.random.default_rng(seed)
    f = get_format(fmt)
    gu = _tiled(f.quantize((rng.standard_normal((1, 2 * I, D)) * 0.02).astype(np.float32), "numba"), E)
    dn = _tiled(f.quantize((rng.standard_normal((1, D, I)) * 0.02).astype(np.float32), "numba"), E)
    return gu, dn


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench placement")
    ap.add_argument("--experts", default="q4_0", help="the experts' format (default %(default)s)")
    ap.add_argument("--shape", default="4096,14336,8,2", metavar="D,I,E,A", help="hidden, intermediate, experts, top-k "
                    "(default Mixtral's: %(default)s)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--backend", default="cuda-emu", choices=["cuda-emu", "cuda"],
                    help="the device the routing and the glue run on (default %(default)s; cuda: a GPU)")
    ap.add_argument("--threads", default=None, metavar="LIST", help="thread counts (default: 1 and every core)")
    args = ap.parse_args(argv)
    D, I, E, A = (int(v) for v in args.shape.split(","))

    from ..cpu import api as cpu
    from ..cpu.fused_moe import fused_moe
    from ..model.moe import hybrid_experts
    from ..model.placement import Places, layer_bus_bytes
    from ..model.runtime import Runtime

    gu, dn = _layer(args.experts, D, I, E)
    for qt in (gu, dn):
        cpu.mark_activations(qt, cpu.check_activations(None))
    rt = Runtime(args.backend, None, Places(np.ones((1, E), bool), "--cpu-moe"))
    experts = hybrid_experts(rt, {"gate_up": gu, "down": dn}, np.ones(E, bool))
    rng = np.random.default_rng(1)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else thread_counts()
    bw = {t: memory_bandwidth(t) for t in threads}
    print(bandwidth_line(bw))
    rows = []
    nbytes = (gu.nbytes + dn.nbytes) / E * A  # the bytes one token reads: A experts
    for t in threads:
        set_threads(t)
        split, whole, alone, moved = [], [], [], None
        for r in range(args.reps + 1):  # interleaved: one of each per round; round 0 warms both up
            ids = rng.choice(E, A, replace=False).astype(np.int32)[None]  # [1, A]
            wts = np.full((1, A), 1.0 / A, np.float32)
            x = rng.standard_normal((1, D)).astype(np.float32)
            xd, idd, wd = rt.device.to_device(x), rt.device.to_device(ids), rt.device.to_device(wts)
            before, h0 = rt.device.counters.snapshot(), experts.host_s
            t0 = time.perf_counter()
            y = experts(xd, idd, wd)
            t1 = time.perf_counter()
            host_s = experts.host_s - h0
            c = rt.device.counters.since(before)
            yref = fused_moe(x, wts, ids, gu, dn)
            t2 = time.perf_counter()
            if r:
                split.append(host_s)
                whole.append(t1 - t0)
                alone.append(t2 - t1)
                moved = c
            np.testing.assert_allclose(rt.host(y), yref, rtol=1e-5, atol=1e-5 * float(np.abs(yref).max()))
        want = layer_bus_bytes(1, 1, D, A)
        s, a = statistics.median(split), statistics.median(alone)
        rows.append({"threads": t, "format": args.experts, "host group in the hybrid layer us": s * 1e6,
                     "fused_moe alone us": a * 1e6, "split / alone": s / a, "host GB/s": nbytes / s / 1e9,
                     "whole hybrid call us (emulated device glue)": statistics.median(whole) * 1e6,
                     "of bandwidth": f"{100 * nbytes / s / 1e9 / bw[t]:.0f} %",
                     "bus in / out B": f"{moved.bytes_in} / {moved.bytes_out}",
                     "formula in / out B": f"{want['in']} / {want['out']}"})
    print_table(rows, f"one token through a layer of D {D}, I {I}, E {E}, top-{A}, every expert on the host (--cpu-moe; "
                      f"device: {args.backend}), against the Numba fused_moe alone on the same experts; medians of {args.reps} "
                      f"interleaved rounds")
    return rows
