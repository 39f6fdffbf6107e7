"""``python -m toolkit.bench moe``: the quantized MoE pipeline on Mixtral's expert shape, in one process.

Measures, per format and per thread count (Numba threads and NumPy/OpenBLAS threads set together):
  decode GEMV   moe_gemm, 1 token top-2: reads 2 experts' gate_up ``[2I, D]``;
  decode layer  fused_moe, 1 token top-2 (GEMM1 + silu + GEMM2 + combine);
  prefill       fused_moe at ``--tokens`` tokens: GFLOP/s beside fp32 BLAS (NumPy matmul) on the same
                per-expert GEMM shapes (one dense expert reused, same FLOPs).
Times are medians; GB/s counts the touched bytes (the routed experts' stored weights, scales included);
``of bw`` is that over the streaming-read bandwidth measured in the same run with as many threads.
PyTorch CPU anchors on one expert's gate_up at 1 token: ``_weight_int4pack_mm_for_cpu`` (int4, g128),
``_weight_int8pack_mm`` (int8), bf16 and fp32 ``F.linear``; ``ours/torch`` is the time ratio of our
GEMV for the matching format (``-`` when that format was not run).
Shapes: ``D`` hidden 4096, ``I`` 14336, ``E`` experts (8), top-2. Experts are generated and quantized one at
a time (never all of them in f32). ``--quick`` runs a small shape as a smoke test.
"""
from __future__ import annotations

import argparse

import numpy as np

from ..cpu.moe_gemm import int8_applies, mark_activations
from ..formats import QTensor, get_format
from ..ops import get_op
from .timing import median_seconds, memory_bandwidth, print_table, set_threads, thread_counts

DEFAULT_FORMATS = "int8,fp8,int4-g128,int3-g128,int2-g128,q8_0,q4_0,bf16"


def stacked_experts(fmt, E: int, n: int, k: int, rng) -> QTensor:
    """QTensor [E, n, k], quantized expert by expert with the Numba codec."""
    parts = [fmt.quantize(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02), "numba") for _ in range(E)]
    arrays = {a: np.stack([p.arrays[a] for p in parts]) for a in parts[0].arrays}
    return QTensor(fmt, (E, n, k), arrays)


def torch_anchors(D: int, I: int, reps: int, threads: int) -> dict:
    """name -> seconds for one [2I, D] weight times a 1-token activation, torch on ``threads`` threads."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    out = {}
    w = torch.randn(2 * I, D) * 0.02
    x = torch.randn(1, D)
    out["f32"] = median_seconds(lambda: F.linear(x, w), reps=reps)
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    out["bf16"] = median_seconds(lambda: F.linear(xb, wb), reps=reps)
    s8 = w.abs().amax(1) / 127
    q8 = torch.clamp(torch.round(w / s8[:, None]), -127, 127).to(torch.int8)
    out["int8"] = median_seconds(lambda: torch._weight_int8pack_mm(xb, q8, s8.to(torch.bfloat16)), reps=reps)
    g = 128
    wg = w.reshape(2 * I, D // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    sc = ((hi - lo) / 15).clamp(min=1e-8)
    q4 = torch.clamp(torch.round((wg - lo[..., None]) / sc[..., None]), 0, 15).to(torch.int32).reshape(2 * I, D)
    zero = lo + 8 * sc  # torch's int4 dequant: (q - 8) * scale + zero
    sz = torch.stack([sc, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [D/g, 2I, 2]
    packed = torch._convert_weight_to_int4pack_for_cpu(q4, 2)
    out["int4-g128"] = median_seconds(lambda: torch._weight_int4pack_mm_for_cpu(xb, packed, g, sz), reps=reps)
    return out


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--threads", default=",".join(map(str, thread_counts())))
    ap.add_argument("--tokens", type=int, default=512, help="prefill tokens")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="D=1024, I=3584, E=4, 64 prefill tokens, 3 reps")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--activations", default="f32,int8",
                    help="f32 and/or int8 (the --activations int8 path: rows only for formats it applies to)")
    ap.add_argument("--decode-only", action="store_true", help="GEMV and decode layer only (no prefill, no BLAS)")
    args = ap.parse_args(argv)
    D, I, E, A, T = 4096, 14336, args.experts, 2, args.tokens
    if args.quick:
        D, I, E, T, args.reps = 1024, 3584, min(E, 4), min(T, 64), 3
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    align, gemm, moe = (get_op(n, "numba") for n in ("moe_align", "moe_gemm", "fused_moe"))

    bw = {t: memory_bandwidth(t, mib=512) for t in threads}
    print("memory bandwidth (streaming read, median; machine may be shared): "
          + ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in bw.items()), flush=True)

    x1 = rng.standard_normal((1, D), dtype=np.float32)
    ids1, tw1 = np.array([[0, 1]], np.int32), np.array([[0.6, 0.4]], np.float32)
    xp = rng.standard_normal((T, D), dtype=np.float32)
    idsp = np.stack([rng.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    twp = np.full((T, A), 1.0 / A, np.float32)
    flops_p = 2.0 * T * A * (2 * I * D + D * I)
    # fp32 BLAS baseline: the same per-expert GEMMs on one dense expert
    wgu = rng.standard_normal((2 * I, D), dtype=np.float32) * np.float32(0.02)
    wdn = rng.standard_normal((D, I), dtype=np.float32) * np.float32(0.02)
    counts = np.bincount(idsp.reshape(-1), minlength=E)
    silu = get_op("silu_and_mul", "numba")

    def blas_prefill():
        for n_e in counts:
            if n_e:
                xe = xp[:n_e]
                silu(xe @ wgu.T) @ wdn.T

    blas = {}
    for t in threads if not args.decode_only else []:
        set_threads(t)
        blas[t] = flops_p / median_seconds(blas_prefill, reps=max(3, args.reps // 2)) / 1e9

    rows, gemv_time = [], {}
    for spec in args.formats.split(","):
        fmt = get_format(spec)
        gate_up, down = stacked_experts(fmt, E, 2 * I, D, rng), stacked_experts(fmt, E, D, I, rng)
        gu_touch = gate_up.nbytes * A / E
        layer_touch = (gate_up.nbytes + down.nbytes) * A / E
        sid, eid, _ = align(ids1, E, 16)
        for t, act in ((t, a) for t in threads for a in args.activations.split(",")):
            if act == "int8" and not int8_applies(gate_up, "int8"):
                continue
            set_threads(t)
            mark_activations(gate_up, act), mark_activations(down, act)  # the kind the kernels run them on
            tg = median_seconds(lambda: gemm(x1, gate_up, sid, eid, 16, A), reps=args.reps)
            tl = median_seconds(lambda: moe(x1, tw1, ids1, gate_up, down), reps=args.reps)
            tp = None if args.decode_only else median_seconds(lambda: moe(xp, twp, idsp, gate_up, down),
                                                              reps=max(2, args.reps // 2))
            gemv_time[(spec, t, act)] = tg / A  # per expert
            rows.append({"format": spec, "activations": act, "threads": t, "bits/w": round(fmt.bits_per_weight((2 * I, D)), 2),
                         "GEMV ms": tg * 1e3, "GEMV GB/s": gu_touch / tg / 1e9, "GEMV of bw": gu_touch / tg / 1e9 / bw[t],
                         "layer ms": tl * 1e3, "layer GB/s": layer_touch / tl / 1e9,
                         "layer of bw": layer_touch / tl / 1e9 / bw[t],
                         **({} if tp is None else {f"prefill{T} ms": tp * 1e3, "prefill GFLOP/s": flops_p / tp / 1e9,
                                                   "vs fp32 BLAS": flops_p / tp / 1e9 / blas[t]})})
        del gate_up, down
    print_table(rows, f"MoE on D={D}, I={I}, E={E}, top-{A}: decode = 1 token; prefill = {T} tokens "
                      f"(fp32 BLAS: " + ", ".join(f"{t} thr {g:.1f} GFLOP/s" for t, g in blas.items()) + ")")

    if not args.no_torch:
        arows = []
        for t in threads:
            set_threads(t)
            for name, ts in torch_anchors(D, I, args.reps, t).items():
                row = {"anchor": name, "threads": t, "torch ms": ts * 1e3}
                for act in ("f32", "int8"):
                    ours = gemv_time.get((name, t, act))
                    row[f"ours {act}-act ms"] = ours * 1e3 if ours else "-"
                    row[f"torch/ours ({act})"] = ts / ours if ours else "-"
                arows.append(row)
        print_table(arows, f"PyTorch CPU anchors: one expert gate_up [{2 * I}, {D}] x 1 token (ours: GEMV time / 2; "
                          f"torch/ours > 1: ours faster)")
    return rows
