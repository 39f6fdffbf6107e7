"""``python -m toolkit.bench cuda``: the CUDA MoE kernels on Mixtral's expert shapes, timed on one GPU.

GEMM1 (``moe_gemm``, gate+up ``[E, 2I, D]``, top-k routed) at M tokens in ``--tokens`` per weight format:
  time   median of ``--reps`` (>= 50) CUDA-event-timed runs after warm-up (routing + moe_align done once,
         outside the timed region; the timed call is the launcher: fp8 activation quant for W8A8 + the GEMM);
  TFLOPS flops = 2*M*top_k*K*N (K = D, N = 2I);
  GB/s   seed formula (REFERENCE section 4): bytes = M*K*a_bytes + E*N*K*b_bytes + M*top_k*N*c_bytes with
         a_bytes = c_bytes = 4 (f32 activations in and out) and b_bytes = the format's code bits / 8 (all E
         experts, scales ignored); and touched bytes: activations + outputs + the stored bytes (scales
         included) of the experts actually routed;
  of HBM touched GB/s over 4.8 TB/s (H200 spec; ~4.26 TB/s is a measured copy); of peak: TFLOPS over the
         dense tensor peak (989 TFLOPS bf16; 1979 fp8 for the W8A8 format);
  dense  the in-run anchor: ``cupy.matmul`` of [M*top_k, D] x [D, 2I] in float16 (CuPy has no bfloat16
         dtype, so fp16 stands in for bf16: same bytes, same tensor-core rate), one 235 MB weight (> L2).
Then the full fused MoE layer (``fused_moe``: align + GEMM1 + silu + GEMM2 + combine) at ``--layer-tokens``.
Weights are random packed codes generated on the GPU (valid codes per format; nothing quantized on the host);
8 experts of 28672 x 4096 exceed the 60 MB L2 for every format. bf16 weights: no CUDA decoder in moe_gemm
(the fp16 dense anchor stands in). Bounded to ``--budget`` seconds (rows past it are listed as skipped).
Each row is printed as it is measured (one line, flushed), so a run cut short keeps every row it finished;
``--rows FILE`` also appends them to FILE as TSV lines.
``--dry-run``: the same plumbing through the emulated device (cuda_src/emu) on tiny shapes, wall-clock
timed (tests/test_cuda_emulated.py runs it). Without a GPU (and without --dry-run) it exits with a message.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ..backend import cuda_unavailable_reason
from ..formats import QTensor, get_format
from ..formats.kquant import SPECS as KQUANT_SPECS
from .timing import RowStream, print_table

DEFAULT_FORMATS = "int8,fp8,int4-g128,int3-g128,int2-g128"
HBM_BYTES_S = 4.8e12
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}


def uniform(xp, shape):
    """f32 in [0, 1) generated where ``xp`` computes (NumPy's random() takes no dtype)."""
    if xp is np or getattr(xp, "random", None) is np.random:  # NumPy, or the emulated device's namespace
        return np.random.random(shape).astype(np.float32)
    return xp.random.random(shape, dtype=np.float32)


def random_qtensor(xp, fmt, shape) -> QTensor:
    """A QTensor of valid random codes with small positive scales, generated where ``xp`` computes."""
    arrays = {}
    for name, spec in fmt.arrays(shape).items():
        dt = np.dtype(spec.dtype)
        if dt == np.int8:
            a = xp.random.randint(-127, 128, spec.shape, dtype=np.int8)
        elif dt == np.uint8 and fmt.name == "fp8":  # e4m3 codes without NaN (0x7f / 0xff): magnitude 0..0x7e
            a = xp.random.randint(0, 0x7F, spec.shape, dtype=np.uint8) | (xp.random.randint(0, 2, spec.shape, dtype=np.uint8) << 7)
        elif dt == np.uint8 and name == "blocks":  # GGML blocks: random bytes, then a sane f16 scale per block
            a = xp.random.randint(0, 256, spec.shape, dtype=np.uint8)
            bb = fmt.block[1]  # bytes per block, from the format record
            if fmt.name == "mxfp4":  # the e8m0 exponent byte: 2^-7
                a.reshape(-1, bb)[:, 0] = 120
            else:  # every f16 field (d; dmin or m): random bytes could be a NaN, or a k-quant d too big to repack
                for at in KQUANT_SPECS[fmt.name].halves if fmt.name in KQUANT_SPECS else (0,):
                    a.reshape(-1, bb)[:, at] = 0x00
                    a.reshape(-1, bb)[:, at + 1] = 0x1C  # f16 0x1C00 = 2^-8
        elif dt == np.uint8:
            a = xp.random.randint(0, 256, spec.shape, dtype=np.uint8)
        elif dt in (np.float32, np.float16):
            a = (uniform(xp, spec.shape) * np.float32(0.01) + np.float32(1e-3)).astype(dt)
            if name == "biases":
                a = -a
        else:
            raise ValueError(f"bench cuda: format {fmt.spec!r} array {name!r} of {dt} has no CUDA decoder")
        arrays[name] = xp.ascontiguousarray(a)
    return QTensor(fmt, tuple(shape), arrays)


class LaunchTimer:
    """Median seconds of the kernels a launcher issues, not of the Python around them: the launcher runs once
    under ``Device.recording`` (its launches, GEMMs and memsets become a :class:`~toolkit.gpu.device.Plan`);
    on a GPU the plan is captured as a CUDA graph and each timed run is one graph launch between two CUDA
    events on the device's stream; emulated (``--dry-run``), the plan is replayed and timed by the wall clock."""

    def __init__(self, dev):
        self.dev = dev

    def __call__(self, launcher, reps: int, warmup: int = 3) -> float:
        from ..gpu.device import Plan

        dev, plan = self.dev, Plan()
        with dev.recording(plan):
            launcher()
        if plan.capture(dev):
            cp, stream = dev.cupy, dev.stream
            for _ in range(warmup):
                plan.replay(dev)
            stream.synchronize()
            start, end, ts = cp.cuda.Event(), cp.cuda.Event(), []
            for _ in range(reps):
                start.record(stream)
                plan.replay(dev)
                end.record(stream)
                end.synchronize()
                ts.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
            return statistics.median(ts)
        ts = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            plan.replay(dev)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


class EventTimer:
    """Median seconds of fn() over reps runs after warm-up, each bracketed by CUDA events (the dense anchor:
    one cuBLAS call, whose launch is all the Python there is)."""

    def __init__(self, dev):
        self.dev = dev

    def __call__(self, fn, reps: int, warmup: int = 3) -> float:
        cp, stream = self.dev.cupy, self.dev.stream
        with stream:
            for _ in range(warmup):
                fn()
            stream.synchronize()
            start, end, ts = cp.cuda.Event(), cp.cuda.Event(), []
            for _ in range(reps):
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                ts.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(ts)


class WallTimer:
    """The dry-run timer: wall clock (the emulation runs synchronously on the CPU)."""

    def __call__(self, fn, reps: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


def routing(M: int, E: int, A: int, rng):
    ids = np.argsort(rng.random((M, E)), axis=1)[:, :A].astype(np.int32)  # [M, A] distinct experts per token
    tw = np.full((M, A), 1.0 / A, np.float32)  # [M, A]
    return ids, tw


def block_m_for(rt, weights, M: int, A: int, E: int) -> int:
    """The model path's block_m (``toolkit/gpu/ops.py`` fused_moe): 128 only where every weight has that kernel."""
    from ..gpu.moe_gemm_mma import block_m_for as table, has_wide

    return table(M * A, E, all(has_wide(rt, w) for w in weights))


def model_decode(backend: str, spec: str, n_tokens: int, prompt_tokens: int = 200) -> list[dict]:
    """Decode tok/s of the bundled model on ``backend``, with the recorded step replayed eagerly and as a
    captured CUDA graph (the graph row only where the device can capture)."""
    from pathlib import Path

    from ..model import SamplingParams, generate_tokens
    from ..load import load_model
    from ..quant import parse_policy

    root = Path(__file__).resolve().parents[2]
    policy = parse_policy("moqe", spec) if spec != "none" else parse_policy("none")
    model, tok = load_model(root / "data" / "model", backend=backend, policy=policy, kv_cache="q8_0")
    prompt = tok.encode((root / "data" / "heldout.txt").read_text()[:4000])[:prompt_tokens]
    rows = []
    for graphs in (False, True):
        if graphs and backend != "cuda":
            continue
        model.cuda_graphs = graphs
        params = SamplingParams(max_new_tokens=n_tokens)
        for _ in range(2):  # the second run is timed (the first records the step, captures the graph)
            t0 = time.perf_counter()
            stamps = [time.perf_counter() for _ in generate_tokens(model, [prompt], params)]
        decode = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
        rows.append({"experts": spec, "KV": "q8_0", "cuda graph": "yes" if graphs else "no",
                     f"prefill ms ({len(prompt)} tok)": (stamps[0] - t0) * 1e3, "decode ms/token": decode * 1e3,
                     "decode tok/s": 1 / decode if decode > 0 else "-"})
    return rows


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096", help="M values for GEMM1")
    ap.add_argument("--layer-tokens", default="1,16,256", help="M values for the fused layer")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later rows are skipped")
    ap.add_argument("--dry-run", action="store_true", help="emulated kernels on tiny shapes (no GPU needed)")
    ap.add_argument("--model-decode", default="none,int4-g128,q4_0",
                    help="expert formats for the whole-model decode rows (bundled model; '' to skip)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rows", default=None, help="append every row, as measured, to this TSV file")
    ap.add_argument("--model-only", action="store_true",
                    help="print the roofline (bytes, FLOPs, ideal time on an H200) and exit: no GPU needed")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.model_only:
        from . import roofline

        rows = roofline.rows(args.formats.split(","), tokens)
        print_table(rows, f"roofline of the grouped expert GEMM, Mixtral 8x7B (E={roofline.E}, top-{roofline.A}, "
                          f"D={roofline.D}, I={roofline.I}) on an H200: {roofline.HBM_BYTES_S / 1e12:.2f} TB/s, "
                          f"{roofline.PEAK['f16'] / 1e12:.0f} TFLOPS f16/bf16, {roofline.PEAK['e4m3'] / 1e12:.0f} e4m3; "
                          "bytes = stored experts touched + f16 (e4m3) activations + f32 outputs")
        return rows
    from ..gpu.device import device
    from ..gpu.fused_moe import run_fused_moe
    from ..gpu.moe_align import run_moe_align
    from ..gpu import mma_pack
    from ..gpu.moe_gemm import run_moe_gemm
    from ..gpu.moe_gemm_mma import tensor_cores

    E, A, D, I = 8, 2, 4096, 14336
    layer_tokens = [int(t) for t in args.layer_tokens.split(",") if t]
    if args.dry_run:
        E, D, I, args.reps = 4, 128, 128, min(args.reps, 2)
        tokens, layer_tokens = [t for t in tokens if t <= 8] or [1], [t for t in layer_tokens if t <= 8] or [1]
        rt = device("cuda-emu")
        timer, dense_timer, where = LaunchTimer(rt), WallTimer(), "CPU emulation (dry run: wall clock, tiny shapes)"
    else:
        why = cuda_unavailable_reason()
        if why:
            raise SystemExit(f"python -m toolkit.bench cuda: needs a CUDA GPU: {why}. "
                             f"Use --dry-run to exercise the plumbing through the CPU emulation.")
        import cupy

        rt = device("cuda")
        timer, dense_timer = LaunchTimer(rt), EventTimer(rt)
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        where = (f"{props['name'].decode()} (L2 {props['l2CacheSize'] / 2**20:.0f} MiB), CUDA events around "
                 f"captured graphs of the kernels (no Python in the timed region)")
    xp, rng, t_start = rt.xp, np.random.default_rng(0), time.perf_counter()
    N, K = 2 * I, D
    print(f"bench cuda on {where}: D={D}, I={I}, E={E}, top-{A}; median of {args.reps} runs", flush=True)
    skipped: list[str] = []

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_start > args.budget:
            skipped.append(what)
            return True
        return False

    # the dense anchor: [M*A, D] x [D, 2I] fp16 (CuPy has no bf16)
    w_dense = (uniform(xp, (K, N)) * np.float32(0.02)).astype(np.float16)
    dense = {}
    try:
        for M in tokens:
            xa = xp.asarray(rng.standard_normal((M * A, K), dtype=np.float32).astype(np.float16))
            dense[M] = dense_timer(lambda: xp.matmul(xa, w_dense), args.reps)
    except Exception as e:  # e.g. no cuBLAS library next to CuPy: the kernels still run
        print(f"dense fp16 anchor unavailable ({type(e).__name__}: {e})", flush=True)
    del w_dense

    rows = RowStream(f"GEMM1 [E={E}, 2I={N}, D={K}], top-{A}: of HBM = touched GB/s / 4.8 TB/s; of peak = TFLOPS / "
                     f"989 (1979 for fp8 W8A8); dense = cupy.matmul fp16 [M*{A}, {K}] x [{K}, {N}]", args.rows)
    lrows = RowStream(f"fused MoE layer (align + GEMM1 + silu + GEMM2 + combine), D={D}, I={I}, E={E}, top-{A}", args.rows)
    for spec in args.formats.split(","):
        fmt = get_format(spec)
        gate_up = random_qtensor(xp, fmt, (E, N, K))  # [E, 2I, D]
        if mma_pack.packable(gate_up) and tensor_cores(rt):  # as the model uploads routed experts
            gate_up = mma_pack.pack(gate_up, halves=True)
        per_expert = gate_up.nbytes / E
        b_bytes = fmt.bits / 8  # code bits from the format record (scales not counted, as the seed formula)
        peak = PEAK_FLOPS["fp8" if fmt.act_quant is not None else "bf16"]
        for M in tokens:
            if over_budget(f"GEMM1 {spec} M={M}"):
                continue
            ids, _ = routing(M, E, A, rng)
            bm = block_m_for(rt, [gate_up], M, A, E)
            sorted_ids, expert_ids, _ = run_moe_align(rt, rt.to_device(ids), E, bm)
            x = rt.to_device(rng.standard_normal((M, K), dtype=np.float32))
            t = timer(lambda: run_moe_gemm(rt, x, gate_up, sorted_ids, expert_ids, bm, A), args.reps)
            flops = 2.0 * M * A * K * N
            seed_bytes = M * K * 4 + E * N * K * b_bytes + M * A * N * 4
            touched = M * K * 4 + len(np.unique(ids)) * per_expert + M * A * N * 4
            rows.add({"format": spec, "M": M, "block_m": bm, "us": t * 1e6, "TFLOPS": flops / t / 1e12,
                         "GB/s seed": seed_bytes / t / 1e9, "GB/s touched": touched / t / 1e9,
                         "of HBM": touched / t / HBM_BYTES_S, "of peak": flops / t / peak,
                         "dense fp16 us": dense[M] * 1e6 if M in dense else "-",
                         "ours/dense": t / dense[M] if M in dense else "-"})
        if layer_tokens and not over_budget(f"fused layer {spec}"):
            down = random_qtensor(xp, fmt, (E, D, I))  # [E, D, I]
            if mma_pack.packable(down) and tensor_cores(rt):
                down = mma_pack.pack(down)
            for M in layer_tokens:
                if over_budget(f"fused layer {spec} M={M}"):
                    continue
                ids, tw = routing(M, E, A, rng)
                bm = block_m_for(rt, [gate_up, down], M, A, E)
                x, idsd, twd = (rt.to_device(a) for a in (rng.standard_normal((M, D), dtype=np.float32), ids, tw))
                t = timer(lambda: run_fused_moe(rt, x, twd, idsd, gate_up, down, bm), args.reps)
                touched = len(np.unique(ids)) * (gate_up.nbytes + down.nbytes) / E + 2 * M * D * 4
                flops = 2.0 * M * A * (N * D + D * I)
                lrows.add({"format": spec, "M": M, "block_m": bm, "us": t * 1e6, "TFLOPS": flops / t / 1e12,
                              "GB/s touched": touched / t / 1e9, "of HBM": touched / t / HBM_BYTES_S})
            del down
        del gate_up
    if not args.dry_run:  # the measured GEMM1 times beside the roofline (Mixtral's shapes only)
        from . import roofline

        measured = {("GEMM1", r["format"], r["M"]): r["us"] for r in rows.rows}
        print_table(roofline.rows(args.formats.split(","), tokens, ("GEMM1",), measured),
                    "GEMM1 measured against the roofline (of ideal = ideal us / measured us)")
    drows = RowStream("whole-model decode, bundled model (data/model), batch 1, greedy, wall clock per token "
                      "(host loop included: token id in, sampled id out)", args.rows)
    for spec in [f for f in args.model_decode.split(",") if f]:
        if over_budget(f"model decode {spec}"):
            continue
        for row in model_decode(rt.name, spec, 2 if args.dry_run else args.decode_tokens, 8 if args.dry_run else 200):
            drows.add(row)
    if skipped:
        print(f"\nskipped after the {args.budget:.0f} s budget: " + ", ".join(skipped), flush=True)
    print(f"\nbench cuda: {time.perf_counter() - t_start:.1f} s", flush=True)
    return rows.rows + lrows.rows


if __name__ == "__main__":
    run(sys.argv[1:])
