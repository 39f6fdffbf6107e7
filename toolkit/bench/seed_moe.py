"""``python -m toolkit.bench.seed_moe``: the seed's fused-MoE table (ROCm/triton PR #693) on one GPU (gpu-check step 5).

``moe_gemm`` (the grouped expert GEMM, top-2 routed) with weights ``[E, N, K]``, E = 8, K = 4096, N in ``--n``
(14336 and 7168 as the seed's table; 28672 is GEMM1 with gate and up), M tokens in ``--tokens``, per format:
  int8 (W8A16), fp8 (W8A8: the launcher quantizes activations to e4m3) and int4-g128.
  TFLOPS  flops = 2*M*top_k*K*N;
  GB/s    seed: bytes = M*K*a_bytes + E*N*K*b_bytes + M*top_k*N*c_bytes with the seed's bytes per element
          (a/b/c: fp8 1/1/2, W8A16 2/1/2, int4 2/0.5/2; all E experts, scales ignored); touched: what this
          kernel moves (f32 activations in and out + the stored bytes, scales included, of the routed experts);
  of ...  each as a fraction of the ceilings measured in the same run (``--ceilings``, the TSV written by
          ``python -m toolkit.bench.ceilings``): GB/s over the device copy, TFLOPS over torch's dense GEMM at
          the same shape (bf16; ``_scaled_mm`` e4m3 for fp8); "-" where that ceiling was not measured.
Kernel: "auto" is the runtime's choice (tensor cores on sm_80+, int2/3/4 codes repacked as the model uploads
them); up to ``--splitk-upto`` tokens also "splitk", the f32 split-K GEMV on the stored layout, so a run says which
decode kernel streams best on its GPU.
Weights are random valid codes made on the device (CuPy's generator); each timing rotates over enough weight
copies (and inputs) that the routed bytes exceed 4x the L2, timed as one captured CUDA graph (LaunchTimer).
Every row is printed and appended to ``--rows`` as it is measured. ``--emulate``: cuda-emu, tiny shapes.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import time

import numpy as np

from ..files import read_text
from ..formats import get_format
from .ceilings import copies_for
from .cuda import LaunchTimer, block_m_for, random_qtensor, routing
from .timing import RowStream

# bytes per element the seed counts (a: activations in, b: weights, c: outputs), by format
SEED_BYTES = {"int8": (2, 1, 2), "fp8": (1, 1, 2), "int4-g128": (2, 0.5, 2)}


def read_ceilings(path: str | None) -> dict:
    """{('copy',): GB/s, ('bf16' | 'fp8', M, N): TFLOPS} from a ceilings TSV; rows without a value are left out."""
    out = {}
    if not path or not os.path.lexists(path):  # no ceilings step ran: every fraction is "-"
        return out
    for r in csv.DictReader(io.StringIO(read_text(path, "ceilings table", 1 << 20)), delimiter="\t"):
        if r.get("value", "-") in ("-", "", None):
            continue
        key = ("copy",) if r["ceiling"] == "copy" else (r["ceiling"], int(r["M"]), int(r["N"]))
        out[key] = float(r["value"])
    return out


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench.seed_moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(SEED_BYTES))
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096", help="M values")
    ap.add_argument("--n", default="14336,7168,28672", help="N values (28672: GEMM1's gate and up)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ceilings", default=None, help="the ceilings TSV of this run (python -m toolkit.bench.ceilings)")
    ap.add_argument("--rows", default=None, help="append every row, as measured, to this TSV file")
    ap.add_argument("--emulate", action="store_true", help="cuda-emu on tiny shapes (no GPU)")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each row (tests the streaming)")
    ap.add_argument("--splitk-upto", type=int, default=16,
                    help="up to this M, also time the split-K f32 GEMV kernel on the stored layout (kernel 'splitk'), "
                         "beside the runtime's choice ('auto'): which decode kernel streams best on this GPU")
    args = ap.parse_args(argv)
    from ..gpu import mma_pack
    from ..gpu.device import device
    from ..gpu.moe_align import run_moe_align
    from ..gpu.moe_gemm import default_kind, run_moe_gemm
    from ..gpu.moe_gemm_mma import on_wgmma, tensor_cores

    E, A, K, l2_bytes = 8, 2, 4096, 60e6
    tokens, ns = [int(t) for t in args.tokens.split(",")], [int(n) for n in args.n.split(",")]
    if args.emulate:  # the same plumbing on the CPU emulation: tiny K and N, wall clock
        rt, E, K, args.reps = device("cuda-emu"), 4, 128, 1
        tokens, ns = [t for t in tokens if t <= 4] or [1], [max(32, n // 448) for n in ns]
    else:
        import cupy

        rt = device("cuda")
        l2_bytes = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"]
    ceil, timer, rng, xp = read_ceilings(args.ceilings), LaunchTimer(rt), np.random.default_rng(0), rt.xp
    out = RowStream(f"seed fused-MoE table: moe_gemm [E={E}, N, K={K}], top-{A}; of copy = GB/s / in-run copy GB/s; "
                    f"of GEMM = TFLOPS / torch dense GEMM TFLOPS at [M*{A}, {K}] x [{K}, N] (bf16; e4m3 for fp8)",
                    args.rows)
    for N in ns:
        for spec in args.formats.split(","):
            fmt, (a_b, b_b, c_b) = get_format(spec), SEED_BYTES[spec]
            w0 = random_qtensor(xp, fmt, (E, N, K))  # [E, N, K]
            n_copies = 2 if args.emulate else copies_for(A * w0.nbytes / E, l2_bytes)  # M=1 routes A experts
            stored = [w0] + [random_qtensor(xp, fmt, (E, N, K)) for _ in range(n_copies - 1)]
            ws = stored
            if mma_pack.packable(w0) and tensor_cores(rt):  # as the model uploads routed experts
                ws = [mma_pack.pack(w, halves=N == 2 * 14336) for w in stored]
            gemm = "fp8" if fmt.act_quant is not None else "bf16"
            for M in tokens:
                ids, _ = routing(M, E, A, rng)  # [M, A]
                bm = block_m_for(rt, ws, M, A, E)
                sorted_ids, expert_ids, _ = run_moe_align(rt, rt.to_device(ids), E, bm)
                xs = [rt.to_device(rng.standard_normal((M, K), dtype=np.float32)) for _ in ws]  # [M, K] each
                kinds = [("auto", ws, None)] + ([("splitk", stored, "splitk")] if M <= args.splitk_upto else [])
                for label, weights, kind in kinds:
                    if kind is None and default_kind(rt, fmt, False) == "mma":  # which tensor-core kernel ran
                        label = "wgmma" if on_wgmma(w0, bm) else "mma"

                    def launcher():
                        for x, w in zip(xs, weights):
                            run_moe_gemm(rt, x, w, sorted_ids, expert_ids, bm, A, kind=kind)

                    t = timer(launcher, args.reps) / len(weights)
                    flops = 2.0 * M * A * K * N
                    seed = M * K * a_b + E * N * K * b_b + M * A * N * c_b
                    touched = M * K * 4 + len(np.unique(ids)) * weights[0].nbytes / E + M * A * N * 4
                    copy, dense = ceil.get(("copy",)), ceil.get((gemm, M, N))
                    out.add({"format": spec, "N": N, "M": M, "kernel": label, "block_m": bm, "copies": len(weights),
                             "us": t * 1e6, "TFLOPS": flops / t / 1e12, "GB/s seed": seed / t / 1e9,
                             "GB/s touched": touched / t / 1e9, "seed of copy": seed / t / 1e9 / copy if copy else "-",
                             "touched of copy": touched / t / 1e9 / copy if copy else "-",
                             "of GEMM": flops / t / 1e12 / dense if dense else "-", "GEMM": gemm})
                    if args.pause:
                        time.sleep(args.pause)
            del ws, stored, w0
    return out.rows


if __name__ == "__main__":
    run()
