"""``python -m toolkit.bench.igemm``: the integer-activation grouped GEMM (``toolkit/cpu/igemm.py``) at
Mixtral's expert shapes, beside f32 BLAS on the same per-expert GEMMs, in one process.

Shapes: ``T`` prompt tokens (64), ``E`` experts (8), ``A`` = 2 routed per token, ``D`` hidden (4096), ``I``
intermediate (14336): GEMM1 ``gate_up [E, 2I, D]`` and GEMM2 ``down [E, D, I]`` over the ``T * A`` routed
rows (random top-2 routing, every expert used). Weights are random codes with sane scales (the speed does
not depend on the values); each format's copy is repacked once (``pack s`` column) before timing.
Per format and thread count: median seconds of both GEMMs (activations quantized once per token, not
timed: ``quant ms`` is that step alone), GFLOP/s (2 * rows * (2I*D + D*I) / s) and the ratio to f32 BLAS
(NumPy matmul ``x_e @ W.T`` per expert on one dense f32 expert reused, same FLOPs, same thread count).
``layer tok/s`` estimates the prefill rate of a Mixtral-shaped layer that is not a model's last (every token
through its experts): T / (experts + attention projections q, k, v, o at T tokens in f32 BLAS + LM head of one
token, vocab 8192), what issue 19 asked (>= 200 tok/s for q4_0, q8_0, int4 on one thread). A model's last layer
runs its experts on the last token only (``MoEModel.forward`` with ``last_only``), so a one-layer model's prefill
is mostly its attention.
``bench()`` returns the rows for a caller (``toolkit.bench`` suites call ``run``).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ..cpu import igemm
from ..cpu.igemm_simd import isa
from ..formats import QTensor, get_format
from .timing import median_seconds, print_table, set_threads

DEFAULT_FORMATS = "q4_0,q8_0,int4-g128,int8,int4-g32,int3-g128,int2-g128"


def random_qtensor(fmt, shape, rng) -> QTensor:
    """Random codes, scales near 0.01 (f16 scale bytes of block formats set): a timing stand-in."""
    arrays = {}
    for name, spec in fmt.arrays(shape).items():
        dt = np.dtype(spec.dtype)
        if dt.kind == "f":
            arrays[name] = rng.uniform(0.005, 0.015, spec.shape).astype(dt)
        elif dt == np.int8:
            arrays[name] = rng.integers(-127, 128, spec.shape, dtype=np.int8)
        else:
            arrays[name] = rng.integers(0, 256, spec.shape, dtype=np.uint8)
    if fmt.int_form == "block":  # every block opens with its f16 scale
        blk = arrays["blocks"].reshape(*shape[:-1], shape[-1] // 32, -1)
        blk[..., :2] = np.float16(0.01).reshape(1).view(np.uint8)
    return QTensor(fmt, tuple(shape), arrays)


def _segments(ids: np.ndarray, E: int):
    """Top-k ids [T, A] -> gathered order (slots sorted by expert), rows (token per slot), segments."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")  # slots, grouped by expert
    counts = np.bincount(flat, minlength=E)
    hi = np.cumsum(counts)
    used = counts > 0
    return order, order // ids.shape[1], np.arange(E)[used], (hi - counts)[used], hi[used]


def bench(formats=DEFAULT_FORMATS, threads=(1, 2), T=64, E=8, A=2, D=4096, I=14336, reps=5, seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:A] for _ in range(T)]).astype(np.int32)  # [T, A]
    slots, rows, seg_e, seg_lo, seg_hi = _segments(ids, E)
    R = T * A
    flops = 2.0 * R * (2 * I * D + D * I)
    x = rng.standard_normal((T, D), dtype=np.float32)
    h = rng.standard_normal((R, I), dtype=np.float32)  # GEMM2's input rows, in gathered order
    wgu = rng.standard_normal((2 * I, D), dtype=np.float32) * np.float32(0.02)  # one dense expert, f32
    wdn = rng.standard_normal((D, I), dtype=np.float32) * np.float32(0.02)
    wqkvo = rng.standard_normal((2 * D + 2 * (D // 4), D), dtype=np.float32) * np.float32(0.02)  # q, o, k, v (8 kv heads of 32)
    head = rng.standard_normal((8192, D), dtype=np.float32) * np.float32(0.02)
    xg = x[rows]  # [R, D] gathered
    rows_out = []

    def blas_experts():
        for lo, hi in zip(seg_lo, seg_hi):
            xg[lo:hi] @ wgu.T
            h[lo:hi] @ wdn.T

    def blas_rest():  # attention projections at T tokens + the LM head at the last token
        x @ wqkvo.T
        x[-1:] @ head.T

    base = {}
    for t in threads:
        set_threads(t)
        base[t] = (median_seconds(blas_experts, reps=reps), median_seconds(blas_rest, reps=reps))
    del wgu, wdn
    for spec in formats.split(","):
        fmt = get_format(spec)
        gu, dn = random_qtensor(fmt, (E, 2 * I, D), rng), random_qtensor(fmt, (E, D, I), rng)
        t0 = time.perf_counter()
        igemm.packed(gu), igemm.packed(dn)
        pack_s = time.perf_counter() - t0
        ones = np.ones(R, np.float32)
        act_x = igemm.quantize_act(x)
        act_h = igemm.quantize_act(h)

        def run_int():
            igemm.moe_igemm(gu, act_x, rows, slots, seg_e, seg_lo, seg_hi, ones, R)
            igemm.moe_igemm(dn, act_h, np.arange(R), slots, seg_e, seg_lo, seg_hi, ones, R)

        run_int()  # compile / load from the cache
        for t in threads:
            set_threads(t)
            s = median_seconds(run_int, reps=reps)
            q = median_seconds(lambda: (igemm.quantize_act(x), igemm.quantize_act(h)), reps=reps)
            b_exp, b_rest = base[t]
            rows_out.append({"format": spec, "threads": t, "ms": 1e3 * s, "GFLOP/s": flops / s / 1e9,
                             "x f32 BLAS": b_exp / s, "BLAS GFLOP/s": flops / b_exp / 1e9, "quant ms": 1e3 * q,
                             "layer tok/s": T / (s + q + b_rest), "pack s": pack_s})
        del gu, dn
    return rows_out


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench.igemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="D=1024, I=3584: a smoke test")
    args = ap.parse_args(argv)
    D, I = (1024, 3584) if args.quick else (4096, 14336)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"igemm bench: T={args.tokens} E=8 top-2 D={D} I={I}; dot lowering {isa()}; load average {' '.join(load)}")
    rows = bench(args.formats, tuple(int(t) for t in args.threads.split(",")), T=args.tokens, D=D, I=I, reps=args.reps)
    print_table(rows, "integer GEMM1 + GEMM2 (median) beside f32 BLAS on the same per-expert GEMMs")
    return rows


if __name__ == "__main__":
    run()
