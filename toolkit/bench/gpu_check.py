"""``python -m toolkit.bench gpu_check OUTDIR``: everything the GPU path claims, in one bounded run (``.ci/gpu-check``).

Steps, by value (as the first run on an H100, 2026-12-06, left it: what it could not reach or found wrong first);
each runs as a subprocess (its own process group) with limit = min(its cap, budget left - 8 s):
  device    nvidia-smi, CuPy's device, L2 and the CUDA headers NVRTC will use (cap 30 s)
  ceilings  python -m toolkit.bench.ceilings: copy GB/s, torch bf16 GEMM and _scaled_mm fp8 TFLOPS (cap 60 s)
  mma       pytest tests/test_cuda_mma.py tests/test_cuda_wgmma.py -k gpu: the instructions against the emulator's
            reading of the PTX ISA (cap 45 s)
  moe       python -m toolkit.bench.seed_moe: the seed's fused-MoE table against this run's ceilings (cap 150 s)
  profile   python -m toolkit.bench.ncu_profile: decode (M 1: fp8, int8, int4, int2, q2_K) and prefill (M 4096, int8,
            int4 and fp8) launches under Nsight Compute: DRAM throughput, occupancy, issue slots, largest stalls (cap 60 s)
  kernels   pytest tests/test_cuda_gpu.py (cap 150 s)
  model     pytest tests/test_cuda_model.py tests/test_mixed_experts.py -k gpu: the whole model on cuda against
            numpy (cap 150 s)
  decode    python -m toolkit.bench.mixtral_decode: decode tok/s of a Mixtral-shaped model of 1 and 2 layers (int4,
            fp8 experts; eager and CUDA graph), 32 layers extrapolated (cap 120 s)
  graphs    the bundled model's greedy text with and without --cuda-graphs, identical (cap 75 s)
  placement the bundled model's decode all on the device, --n-cpu-moe 2 and --cpu-moe (tok/s, measured bus bytes),
            then python -m toolkit.bench placement --backend cuda on a Mixtral-shaped layer (cap 60 s)
  ops       pytest tests/test_ops*.py -k "cuda and not emu" (the time left)
At its limit a step gets SIGINT (pytest prints what it has), then SIGKILL 5 s later; it is reported as "time
limit" (as is an exit of 124 or 137) with its output kept. A step with under 5 s left is "skipped: budget
spent". So the whole run ends within the budget (default 440 s, ``--budget`` or $MOQE_GPU_CHECK_BUDGET).
Files in OUTDIR (7): gpu-check.log (every step's output as it arrives, pytest -v), summary.tsv (a line per step
as it ends), ceilings.tsv, seed-moe.tsv, decode.tsv and ncu.tsv (a line per row as measured), ncu.csv (ncu's raw
page). Caches stay where the toolkit keeps
them (~/.cache/moqe, toolkit/paths.py), never in OUTDIR. Without a visible GPU it stops at once with one line
(exit 2). ``--emulate`` (or MOQE_GPU_CHECK_EMULATE=1): the same flow on cuda-emu with tiny shapes; steps that
need torch CUDA or a GPU's tests say "skipped: emulated". Exit status: the number of steps failed or cut.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ("gpu-check.log", "summary.tsv", "ceilings.tsv", "seed-moe.tsv", "decode.tsv", "ncu.tsv", "ncu.csv")
GRACE_S, KILL_S, MIN_STEP_S = 8, 5, 5  # GRACE_S >= KILL_S + the 2 s the output reader is given
CAPS = {"device": 30, "ceilings": 60, "mma": 45, "moe": 150, "profile": 60, "kernels": 150, "model": 150, "decode": 120, "graphs": 75,
        "placement": 60, "ops": 600}  # the order they run in
PYTEST = ["-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider"]
EMULATED = "skipped: emulated (CI runs these tests on cuda-emu and numba)"
RESULT = re.compile(r"::\S*\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def commands(out: Path, emulate: bool, pause: float) -> dict:
    """Step name -> (kind, argv after the interpreter) or a skip reason (str)."""
    emu = ["--emulate"] if emulate else []
    steps = {
        "device": ("plain", ["-m", "toolkit.bench.gpu_check", "--inner", "device", *emu]),
        "ceilings": ("plain", ["-m", "toolkit.bench.ceilings", "--rows", str(out / "ceilings.tsv"), *emu]),
        "model": ("pytest", [*PYTEST, "tests/test_cuda_model.py", "tests/test_mixed_experts.py", "-k", "gpu"]),
        "graphs": ("plain", ["-m", "toolkit.bench.gpu_check", "--inner", "graphs", *emu]),
        "moe": ("plain", ["-m", "toolkit.bench.seed_moe", "--ceilings", str(out / "ceilings.tsv"),
                          "--rows", str(out / "seed-moe.tsv"), "--pause", str(pause), *emu]),
        "decode": ("plain", ["-m", "toolkit.bench.mixtral_decode", "--ceilings", str(out / "ceilings.tsv"),
                             "--rows", str(out / "decode.tsv"), *emu]),
        "placement": ("plain", ["-m", "toolkit.bench.gpu_check", "--inner", "placement", *emu]),
        "profile": ("plain", ["-m", "toolkit.bench.ncu_profile", "--rows", str(out / "ncu.tsv"),
                              "--raw", str(out / "ncu.csv"), *emu]),
        "kernels": ("pytest", [*PYTEST, "tests/test_cuda_gpu.py"]),
        "mma": ("pytest", [*PYTEST, "tests/test_cuda_mma.py", "tests/test_cuda_wgmma.py", "-k", "gpu"]),
        "ops": ("pytest", [*PYTEST, *sorted(glob.glob("tests/test_ops*.py", root_dir=ROOT)), "-k", "cuda and not emu"]),
    }
    steps = {name: steps[name] for name in CAPS}  # in CAPS' order
    if emulate:
        # placement: its emulated run is tests/test_placement.py's (inner_placement), not this budgeted flow's
        steps.update(placement=EMULATED, kernels=EMULATED, mma=EMULATED, ops=EMULATED)
    return steps


class Log:
    def __init__(self, out: Path):
        self.f = open(out / "gpu-check.log", "a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        line = line.rstrip("\n")
        with self.lock:
            print(line, flush=True)
            self.f.write(line + "\n")


def run_step(py: str, argv: list[str], limit: float, log: Log, env: dict) -> tuple[int, bool, list[str]]:
    """Run ``py argv`` in its own process group, its output tee'd into the log line by line; at ``limit`` seconds
    SIGINT, then SIGKILL after KILL_S. Returns (exit status, stopped by the limit, output lines)."""
    proc = subprocess.Popen([py, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            log(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        stopped = True
        for sig, wait in ((signal.SIGINT, KILL_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=2)
    return proc.returncode, stopped, lines


def verdict(kind: str, rc: int, stopped: bool, lines: list[str], limit: float) -> tuple[str, str]:
    """(status, note) of a finished step: ok / skipped / failed / time limit (stopped by us, or an exit of 124 or
    137: a ``timeout`` around it, or a SIGKILL)."""
    stopped = stopped or rc in (124, 137)
    counts: dict[str, int] = {}
    for line in lines:
        m = RESULT.search(line)
        if m and not line.startswith(m.group(1)):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    tally = ", ".join(f"{n} {k.lower()}" for k, n in counts.items())
    if stopped:
        return "time limit", f"stopped at its {limit:.0f} s limit (exit {rc})" + (f"; so far {tally}" if tally else "")
    if rc != 0 and not (kind == "pytest" and rc == 5):
        return "failed", f"exit {rc}" + (f"; {tally}" if tally else "")
    if kind == "pytest" and not counts.get("PASSED"):
        why = next((ln.strip() for ln in lines if ln.startswith("SKIPPED [")), "no test selected")
        return "skipped", f"no test passed or failed ({tally or 'none ran'}): {why[:200]}"
    return "ok", tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="gpu-check-out", help="output folder (default: gpu-check-out)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("MOQE_GPU_CHECK_BUDGET", 440)),
                    help="seconds for the whole run (default 440, or $MOQE_GPU_CHECK_BUDGET)")
    ap.add_argument("--emulate", action="store_true", default=os.environ.get("MOQE_GPU_CHECK_EMULATE") == "1",
                    help="the flow on cuda-emu with tiny shapes, no GPU (or MOQE_GPU_CHECK_EMULATE=1)")
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=S", help="override a step's cap")
    ap.add_argument("--moe-pause", type=float, default=0.0, help="sleep after each seed-table row (tests streaming)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the steps run with")
    ap.add_argument("--inner", choices=("device", "graphs", "placement"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        return {"device": inner_device, "graphs": inner_graphs, "placement": inner_placement}[args.inner](args.emulate)
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # this run's files only
        (out / name).unlink(missing_ok=True)
    log = Log(out)
    if not args.emulate:
        from ..backend import cuda_unavailable_reason

        why = cuda_unavailable_reason()
        if why:
            log(f"gpu-check: no GPU visible ({why}); stopped before any step (--emulate runs the flow on cuda-emu)")
            return 2
    caps = dict(CAPS)
    for item in args.limit:
        step, _, s = item.partition("=")
        caps[step] = float(s)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log(f"== gpu-check {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, budget {args.budget:.0f} s"
        f"{', EMULATED (cuda-emu, tiny shapes)' if args.emulate else ''}, output in {out}")
    summary, failed = [], 0
    with open(out / "summary.tsv", "a", buffering=1) as tsv:
        tsv.write("step\tstatus\tseconds\tlimit_s\tnote\n")
        for name, what in commands(out, args.emulate, args.moe_pause).items():
            left = args.budget - (time.monotonic() - t0)
            limit = min(caps[name], left - GRACE_S)
            ts = time.monotonic()
            if isinstance(what, str):
                status, note, limit = "skipped", what.removeprefix("skipped: "), 0
            elif limit < MIN_STEP_S:
                status, note, limit = "skipped", f"budget spent ({left:.0f} s left)", 0
            else:
                kind, cmd = what
                log(f"== [{ts - t0:.0f} s] {name} (limit {limit:.0f} s): {args.python} {' '.join(cmd)}")
                rc, stopped, lines = run_step(args.python, cmd, limit, log, env)
                status, note = verdict(kind, rc, stopped, lines, limit)
            secs = time.monotonic() - ts
            failed += status in ("failed", "time limit")
            log(f"== {name}: {status} in {secs:.1f} s{': ' + note if note else ''}")
            summary.append((name, status, f"{secs:.1f}", f"{limit:.0f}", note))
            tsv.write("\t".join(summary[-1]) + "\n")
    log(f"\n== gpu-check done in {time.monotonic() - t0:.1f} s of {args.budget:.0f}: {failed} step(s) failed or cut")
    log("| step | status | seconds | limit s | note |\n|---|---|---|---|---|")
    for row in summary:
        log("| " + " | ".join(row) + " |")
    return failed


def inner_device(emulate: bool) -> int:
    """The device step: versions, the device and its L2, the CUDA headers NVRTC will use."""
    import numba
    import numpy

    from ..gpu.source import cuda_include_dirs

    print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__)
    headers = cuda_include_dirs()
    print("CUDA headers for NVRTC:", headers or "NOT FOUND")
    if emulate:
        print("device: cuda-emu (the CPU emulation of the kernels; no GPU)")
        return 0
    import cupy

    subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"])
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print("cupy", cupy.__version__, "device:", props["name"].decode(), f"L2 {props['l2CacheSize'] / 2**20:.0f} MiB,",
          f"cc {props['major']}.{props['minor']}, {props['totalGlobalMem'] / 2**30:.0f} GiB")
    try:
        import torch

        print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())
    except ImportError as e:
        print("torch: not importable:", e)
    return 0 if headers else 1


def inner_graphs(emulate: bool) -> int:
    """The graphs step: the bundled model's greedy text on cuda with and without --cuda-graphs must be identical."""
    backend, prompt, n = ("cuda-emu", "It", 2) if emulate else ("cuda", "It is a truth universally acknowledged", 48)
    texts = []
    for graphs in ([], ["--cuda-graphs"]):
        cmd = [sys.executable, "-m", "toolkit.cli", "generate", "--backend", backend, "--experts", "int4", "--kv-cache",
               "q8_0", "--max-new-tokens", str(n), "--prompt", prompt, *graphs]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(f"$ {' '.join(cmd[1:])}\n{r.stdout}{r.stderr}", flush=True)
        if r.returncode:
            return r.returncode
        texts.append(r.stdout)
    same = texts[0] == texts[1]
    print("same text with and without CUDA graphs" if same else "DIFFERENT text with and without CUDA graphs")
    return 0 if same else 1


def inner_placement(emulate: bool) -> int:
    """The placement step: the bundled model's decode with every routed expert on the device, the first two layers'
    on the host (--n-cpu-moe 2) and all on the host (--cpu-moe), each run's rate and measured bus bytes per step;
    then ``bench placement`` on a Mixtral-shaped layer (the host group inside the hybrid call against the Numba
    fused_moe alone, and the whole call with the GPU's glue)."""
    backend, n = ("cuda-emu", 3) if emulate else ("cuda", 64)
    rows, rc = [], 0
    for place in ([], ["--n-cpu-moe", "2"], ["--cpu-moe"]):
        cmd = [sys.executable, "-m", "toolkit.cli", "generate", "--backend", backend, "--experts", "q4_0", "--ignore-eos",
               "--max-new-tokens", str(n), "--temperature", "0", "--prompt", "It is a truth universally acknowledged", *place]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(f"$ {' '.join(cmd[1:])}\n{r.stdout}{r.stderr}", flush=True)
        rc = rc or r.returncode
        rate = re.search(r"decode \d+ tokens? in [^(]*\(([\d.e+]+) tok/s\)", r.stderr)
        bus = re.search(r"bus per decode step, measured: (in [\d,]+ B, out [\d,]+ B)", r.stderr)
        rows.append(f"| {' '.join(place) or 'all on the device'} | {rate.group(1) if rate else '-'} | "
                    f"{bus.group(1) if bus else '0'} |")
    print("| placement | decode tok/s | bus per step |\n|---|---|---|\n" + "\n".join(rows), flush=True)
    shape = ["--shape", "256,512,8,2", "--reps", "1", "--threads", "1"] if emulate else ["--reps", "5"]
    cmd = [sys.executable, "-m", "toolkit.bench", "placement", "--backend", backend, *shape]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(f"$ {' '.join(cmd[1:])}\n{r.stdout}{r.stderr}", flush=True)
    return rc or r.returncode


def run(argv: list[str] | None = None) -> None:
    raise SystemExit(main(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
