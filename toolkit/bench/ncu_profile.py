"""``python -m toolkit.bench.ncu_profile``: why the decode kernels stream what they stream (gpu-check's profile step).

The first GPU run (H100, 2026-12-06) measured ``moe_gemm`` at M = 1 (N 14336, K 4096, E 8, top-2) streaming
0.74 of the device copy rate with fp8 experts but 0.53 with int8 and 0.44 with int4, where the in-flight bytes
(24 KB an SM, ``toolkit.gpu.occupancy``) and the issue counts (SASS instructions a k-tile) say all three could
stream at the copy rate; and prefill (M 4096) at 0.29 of torch's bf16 GEMM (int8) and 0.51 of ``_scaled_mm``
(fp8) against design ceilings of 0.67 and 0.8. Only the hardware's counters can say what holds them: this runs
each case's launch once under Nsight Compute (``ncu``, in the GPU image) and prints a row per kernel:

  us, DRAM throughput (% of peak, GB/s read), achieved and theoretical occupancy, registers, issue slots busy,
  shared-memory data bank reads and writes and the tensor pipe (% of peak, where the sections report them), and
  the warps' largest stall reasons (cycles per issued instruction, by ncu's WarpStateStats).

Every row is printed and appended to ``--rows`` (TSV) as parsed; ``--raw`` keeps ncu's whole CSV (its raw page:
every metric of the sections below, one line per kernel) for what the row leaves out, appended as ``--rows`` is
(both pass the write rule for appended tables before anything runs: toolkit/writes.py check_append_target). The launches run in a child
process (``--target``) that ncu starts; profiling is on only around the measured launches (cudaProfilerStart /
Stop; each kernel compiled and run once before). Without ``ncu`` it says so and exits 0. ``--emulate``: the child's
launches on cuda-emu with tiny shapes, no ncu (the flow, in CI).
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from ..files import read_text

# (format, M): decode at M 1 (q2_K: its factors and biases made once a super-block, an issue cap of 0.70 by the
# SASS count: its issue slots and DRAM share say whether that holds); prefill at M 4096 (int8 on mma.sync at block_m
# 128, fp8 on wgmma), where the first run measured 0.29 of torch's bf16 GEMM against a design ceiling of 0.67 and
# 0.51 of _scaled_mm; int8 and int4 now make their A fragments from the codes, q6_K (last) decodes into a tile from
# codes loaded into registers (toolkit.gpu.occupancy.prefill_kernels: design ceilings 0.73, 0.69, 0.62)
CASES = "fp8:1,int8:1,int4-g128:1,int2-g64:1,q2_k:1,int8:4096,int4-g128:4096,fp8:4096,q6_k:4096"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats", "MemoryWorkloadAnalysis")
KERNELS = "regex:moe_gemm_(mma|wgmma)"  # the GEMM itself, not the activation quantizer or moe_align
# ncu raw-page metric -> row column (base units: --print-units base)
COLUMNS = {
    "gpu__time_duration.sum": "ns",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM % of peak",
    "dram__bytes_read.sum": "DRAM bytes read",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy %",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical occupancy %",
    "launch__registers_per_thread": "registers",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots busy %",
}
# metrics the sections above collect under names that vary with ncu's version and the architecture: pattern ->
# column, the largest value of the metrics it matches ("-" where none). The shared-memory data banks are what the
# prefill design ceiling counts (toolkit.gpu.occupancy.prefill_table: block_m 128 bound by them at 0.61-0.73 of the
# dense peak); the tensor pipe (mma.sync's HMMA, wgmma's GMMA) is what that leaves the MMAs
MATCHED = {
    r"^l1tex__data_banks?_reads\.avg\.pct_of_peak_sustained_elapsed$": "smem bank reads %",
    r"^l1tex__data_banks?_writes\.avg\.pct_of_peak_sustained_elapsed$": "smem bank writes %",
    r"^sm__pipe_tensor_op_[hg]mma_cycles_active\.avg\.pct_of_peak_sustained_(active|elapsed)$": "tensor pipe %",
}
STALL = "issue_stalled_"


def find_ncu() -> str | None:
    """ncu on PATH, else where CUDA and Nsight Compute install it."""
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu")) +
                                             sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)


def parse_raw_csv(text: str) -> list[dict]:
    """ncu ``--csv --page raw`` output -> one dict a kernel (metric name -> value as printed). The header line
    names the metrics, the next gives their units, then a line a kernel; ncu's own ==PROF== lines are skipped."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header = rows[0]
    return [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def _num(v) -> float | None:
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return None


def summarize(kernel: dict, fmt: str, M: int) -> dict:
    """One table row from one kernel's raw metrics: the COLUMNS that were collected, the MATCHED ones found, GB/s
    read, and the three
    largest stall reasons (metrics named ``*issue_stalled_<reason>*``, one family: the one with most reasons)."""
    row = {"format": fmt, "M": M, "kernel": kernel.get("Kernel Name", "-")[:48]}
    vals = {col: _num(kernel.get(name)) for name, col in COLUMNS.items()}
    ns, read = vals.pop("ns"), vals.pop("DRAM bytes read")
    row["us"] = ns / 1e3 if ns else None
    row["DRAM GB/s read"] = read / ns if read and ns else None
    row.update(vals)
    for pattern, col in MATCHED.items():
        found = [_num(v) for name, v in kernel.items() if re.match(pattern, name) and _num(v) is not None]
        row[col] = max(found) if found else None
    families: dict[str, dict[str, float]] = {}  # "smsp__..._issue_stalled_*_per_..." -> {reason: value}
    for name, v in kernel.items():
        if STALL in name and _num(v) is not None:
            head, tail = name.split(STALL, 1)
            reason = tail.split("_per_")[0].split(".")[0]
            families.setdefault(head + STALL + "*" + tail[len(reason):], {})[reason] = _num(v)
    top = sorted(max(families.values(), key=len).items(), key=lambda kv: -kv[1])[:3] if families else []
    row["top stalls"] = ", ".join(f"{k} {v:.2f}" for k, v in top) or None
    return row


def cases(text: str) -> list[tuple[str, int]]:
    """"fp8:1,int8:4096" -> [("fp8", 1), ("int8", 4096)]."""
    return [(c.split(":")[0], int(c.split(":")[1])) for c in text.split(",") if c]


def target(emulate: bool, todo: list[tuple[str, int]]) -> int:
    """The child ncu starts: each case's launch compiled and run once, then once more with profiling on."""
    from ..formats import get_format
    from ..gpu import mma_pack
    from ..gpu.device import device
    from ..gpu.moe_align import run_moe_align
    from ..gpu.moe_gemm import run_moe_gemm
    from ..gpu.moe_gemm_mma import tensor_cores
    from .cuda import block_m_for, random_qtensor, routing

    E, A, N, K = (4, 2, 64, 128) if emulate else (8, 2, 14336, 4096)
    rt = device("cuda-emu" if emulate else "cuda")
    start, stop, sync = _profiler(emulate)
    rng = np.random.default_rng(0)
    for spec, M in todo:
        M = min(M, 256) if emulate else M  # emulated: still past 128-token blocks
        fmt = get_format(spec)
        # emulated K: 128, or a k-quant's super-block of 256
        w = random_qtensor(rt.xp, fmt, (E, N, max(K, fmt.block[0]) if fmt.block else K))  # [E, N, K]
        if mma_pack.packable(w) and tensor_cores(rt):  # as the model uploads routed experts
            w = mma_pack.pack(w)
        ids, _ = routing(M, E, A, rng)  # [M, A]
        bm = block_m_for(rt, [w], M, A, E)
        sorted_ids, expert_ids, _ = run_moe_align(rt, rt.to_device(ids), E, bm)
        x = rt.to_device(rng.standard_normal((M, w.shape[2]), dtype=np.float32))  # [M, K]
        run_moe_gemm(rt, x, w, sorted_ids, expert_ids, bm, A)  # compiled and run once, not profiled
        sync()
        start()
        run_moe_gemm(rt, x, w, sorted_ids, expert_ids, bm, A)
        sync()
        stop()
        print(f"profiled: {spec} M={M} block_m={bm}", flush=True)
        del w
    return 0


def _profiler(emulate: bool):
    """(start, stop, synchronize): cudaProfilerStart / Stop and a device-wide synchronize; no-ops emulated."""
    if emulate:
        return (lambda: None), (lambda: None), (lambda: None)
    import cupy

    rt = cupy.cuda.runtime
    if hasattr(rt, "profilerStart"):
        return rt.profilerStart, rt.profilerStop, cupy.cuda.Device().synchronize
    from cupy.cuda import profiler  # older CuPy

    return profiler.start, profiler.stop, cupy.cuda.Device().synchronize


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench.ncu_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES, help="format:M, comma-separated")
    ap.add_argument("--rows", default=None, help="append every row, as parsed, to this TSV file")
    ap.add_argument("--raw", default=None, help="append ncu's whole CSV (raw page) to this file")
    ap.add_argument("--emulate", action="store_true", help="the launches on cuda-emu, tiny shapes, no ncu")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    todo = cases(args.cases)
    if args.target or args.emulate:
        rc = target(args.emulate, todo)
        if args.emulate:
            print("ncu_profile: emulated: the launches ran on cuda-emu; no counters without a GPU and ncu")
        return rc
    from ..writes import check_append_target
    from .timing import RowStream

    out = RowStream("moe_gemm under ncu: N 14336, K 4096, E 8, top-2; stalls in cycles per issued instruction",
                    args.rows)  # the write rule for --rows and --raw before anything runs
    raw = check_append_target(args.raw, "ncu raw page") if args.raw else None
    ncu = find_ncu()
    if ncu is None:
        print("ncu_profile: no ncu (Nsight Compute) on PATH, /usr/local/cuda*/bin or /opt/nvidia/nsight-compute: "
              "nothing profiled")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        cmd = [ncu, "--profile-from-start", "off", "--kernel-name", KERNELS, "--csv", "--page", "raw",
               "--print-units", "base", "--log-file", log, "--metrics", "dram__bytes_read.sum,gpu__time_duration.sum"]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, "-m", "toolkit.bench.ncu_profile", "--target", "--cases", args.cases]
        print("$", " ".join(cmd), flush=True)
        r = subprocess.run(cmd)
        text = read_text(log, "ncu's CSV log", 1 << 28) if os.path.exists(log) else ""
    if raw is not None and text:
        with open(raw, "a") as f:  # appended as --rows is: a file already there is added to, never replaced
            f.write(text)
    kernels = parse_raw_csv(text)
    for (fmt, M), k in zip(todo, kernels):
        out.add(summarize(k, fmt, M))
    if len(kernels) != len(todo):
        print(f"ncu_profile: {len(kernels)} kernel(s) profiled for {len(todo)} case(s); ncu exit {r.returncode}"
              + ("" if text else "; no ncu output") + ("\n" + text[-2000:] if text and not kernels else ""))
        return 1
    return r.returncode


if __name__ == "__main__":
    from ..errors import ToolkitError

    try:
        sys.exit(run())
    except ToolkitError as e:  # a refused --rows / --raw target: one line, nothing written
        print(f"ncu_profile: {e}", file=sys.stderr)
        sys.exit(2)
