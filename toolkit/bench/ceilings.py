"""``python -m toolkit.bench.ceilings``: the in-run ceilings the GPU tables are measured against (gpu-check's step 2).

  copy   device-to-device copy GB/s (CuPy ``dst[...] = src`` of 1 GiB, bytes read + bytes written, CUDA events);
  bf16   torch bf16 GEMM TFLOPS, ``[M*top_k, K] x [K, N]`` (the dense GEMM with the FLOPs of the MoE row at M, N);
  fp8    ``torch._scaled_mm`` e4m3 x e4m3 -> bf16 TFLOPS at the same shapes (per-tensor scales).
Shapes: M in ``--tokens``, K = 4096, N in ``--n``, top-2. Each weight is rotated over enough copies that the
copies together exceed 4x the L2 (H200: ~60 MB), so no timing reads L2. Every row is written as measured (one
TSV line, flushed, ``--rows``); a ceiling torch cannot measure here is a row with its reason. ``--emulate``: no
GPU: the copy is a host NumPy copy (labelled so) and the torch rows say "skipped: emulated".
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from .timing import RowStream

A, K = 2, 4096


def copies_for(nbytes: float, l2_bytes: float) -> int:
    """How many copies of ``nbytes`` a timing rotates over so the bytes it reads exceed 4x the L2."""
    return max(1, min(32, math.ceil(4 * l2_bytes / max(nbytes, 1))))


def torch_median(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() between two torch CUDA events on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return statistics.median(ts)


def copy_row(emulate: bool, reps: int) -> dict:
    n = (1 << 20) if emulate else (1 << 30)  # bytes
    if emulate:
        src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            ts.append(time.perf_counter() - t0)
        t, note = statistics.median(ts), "host NumPy copy (emulated: no GPU)"
    else:
        import cupy as cp

        from .cuda import EventTimer
        from ..gpu.device import device

        src, dst = cp.ones(n, cp.uint8), cp.empty(n, cp.uint8)
        t, note = EventTimer(device("cuda"))(lambda: dst.__setitem__(Ellipsis, src), reps), "cupy d2d, read + write"
    return {"ceiling": "copy", "M": "-", "N": "-", "K": "-", "copies": 1, "us": t * 1e6, "value": 2 * n / t / 1e9,
            "unit": "GB/s", "note": note}


def gemm_calls(kind: str, N: int, l2_bytes: float):
    """torch's dense weights [K, N] for ``kind`` ('bf16', or 'fp8': e4m3 through ``torch._scaled_mm``), made on the
    device, as many copies as rotate past the L2; returns (weights, call(x, w), cast of a bf16 x)."""
    import torch

    n_copies = copies_for(K * N * (2 if kind == "bf16" else 1), l2_bytes)
    if kind == "bf16":
        ws = [torch.randn(K, N, device="cuda", dtype=torch.bfloat16) for _ in range(n_copies)]
        return ws, torch.matmul, lambda x: x
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise NotImplementedError(f"torch {torch.__version__} has no _scaled_mm / float8_e4m3fn")
    one = torch.ones((), device="cuda", dtype=torch.float32)
    ws = [torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn).t() for _ in range(n_copies)]  # [K, N] col-major
    return (ws, lambda x, w: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            lambda x: x.to(torch.float8_e4m3fn))


def gemm_row(M: int, N: int, kind: str, ws, call, cast, reps: int) -> dict:
    """The dense GEMM [M*A, K] x [K, N], rotated over the weight copies ``ws``."""
    import torch

    xs = [cast(torch.randn(M * A, K, device="cuda").to(torch.bfloat16)) for _ in ws]  # [M*A, K] row-major each

    def rotate():
        for x, w in zip(xs, ws):
            call(x, w)

    t = torch_median(rotate, reps) / len(ws)
    return {"ceiling": kind, "M": M, "N": N, "K": K, "copies": len(ws), "us": t * 1e6,
            "value": 2.0 * M * A * K * N / t / 1e12, "unit": "TFLOPS", "note": f"torch {torch.__version__}"}


def reason(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench.ceilings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096", help="M values")
    ap.add_argument("--n", default="14336,7168,28672", help="N values (28672: GEMM1's gate and up)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default=None, help="append every row, as measured, to this TSV file")
    ap.add_argument("--emulate", action="store_true", help="no GPU: host copy only, torch rows skipped")
    args = ap.parse_args(argv)
    out = RowStream(f"in-run ceilings: copy GB/s, dense GEMM TFLOPS of [M*{A}, {K}] x [{K}, N]", args.rows)
    out.add(copy_row(args.emulate, args.reps))
    l2_bytes = 60e6
    if not args.emulate:
        import cupy

        l2_bytes = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"]
    for kind in ("bf16", "fp8"):
        for N in (int(n) for n in args.n.split(",")):
            weights, why = None, "emulated (needs torch CUDA)" if args.emulate else None
            if why is None:
                try:
                    weights = gemm_calls(kind, N, l2_bytes)
                except Exception as e:  # e.g. a torch without fp8 GEMMs: its rows say why, the rest still run
                    why = reason(e)
            for M in (int(m) for m in args.tokens.split(",")):
                try:
                    if weights is not None:
                        out.add(gemm_row(M, N, kind, *weights, args.reps))
                        continue
                except Exception as e:  # this shape only (e.g. a size _scaled_mm rejects)
                    why = reason(e)
                out.add({"ceiling": kind, "M": M, "N": N, "K": K, "copies": "-", "us": "-", "value": "-",
                         "unit": "TFLOPS", "note": f"skipped: {why}"})
            del weights
    return out.rows


if __name__ == "__main__":
    run()
