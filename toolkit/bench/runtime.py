"""``python -m toolkit.bench runtime``: prefill and decode tokens/s of the bundled model, 1 thread and all.

Prefill: one forward over a held-out prompt of ``--prompt-tokens``; decode: ``--new-tokens`` greedy steps
after it (the mean per-step time: the statistic `moqe generate` prints). Optionally with a quantization policy and a KV cache type; ``--kv-rotate
off,on`` measures the key rotation's settings one after the other in the same run (a row each). ``peak RSS GB``:
the process's peak resident set from the start of that policy's load to the end of the row (the peak is reset
before each load where Linux allows it, ``toolkit.mapped.reset_peak``; else the process's whole life).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ..load import load_model
from ..mapped import reset_peak, resident
from ..quant import parse_policy
from .timing import median_seconds, print_table, set_threads, thread_counts

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench runtime", description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--policy", default="none")
    ap.add_argument("--experts", default=None, help="expert formats, comma-separated: a row set each, same run")
    ap.add_argument("--plan", default=None, metavar="FILE", help="also a plan file's mixed-width experts (moqe plan)")
    ap.add_argument("--kv-cache", default=None)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--compiled-decode", choices=["on", "off"], default="on",
                    help="numba: decode through the compiled per-layer step (on, compiled in the warm-up) or the staged ops")
    ap.add_argument("--kv-rotate", default="auto", metavar="R[,R...]",
                    help="key rotation of the cache (auto, on, off); several, comma-separated: a row each")
    args = ap.parse_args(argv)
    rotations = args.kv_rotate.split(",")
    if set(rotations) - {"auto", "on", "off"}:
        ap.error(f"--kv-rotate: auto, on or off, comma-separated; got {args.kv_rotate!r}")

    policies = [parse_policy(args.policy, e) for e in (args.experts.split(",") if args.experts else [None])]
    if args.plan:
        from ..model import load_config
        from ..quant.plan import plan_policy

        policies.append(plan_policy(args.plan, load_config(args.model)))
    rows = []
    for policy in policies:
        rows += _measure(args, policy, rotations)
    print_table(rows, f"runtime on {Path(args.model).name} ({args.backend})")
    return rows


def _measure(args, policy, rotations) -> list[dict]:
    """Prefill and decode rows of one policy, each thread count x rotation."""
    reset_peak()  # the previous policy's model is gone: its peak is not this one's
    model, tok = load_model(args.model, backend=args.backend, policy=policy, kv_cache=args.kv_cache)
    model.compiled_decode = args.compiled_decode
    ids = np.array([tok.encode((ROOT / "data" / "heldout.txt").read_text())[: args.prompt_tokens]])
    rows = []
    for threads, rotate in ((t, r) for t in thread_counts() for r in rotations):
        set_threads(threads)  # Numba's pool, the kernels' picker and BLAS together
        model.kv_rotate = rotate
        ctx = ids.shape[1] + args.new_tokens + 1  # + the warm-up step

        def prefill():
            c = model.new_cache(1, ctx)
            model.forward(ids, c, last_only=True)
            return c

        t_prefill = median_seconds(prefill, reps=3, warmup=1)
        cache = prefill()
        model.forward(np.array([[int(ids[0, -1])]]), cache, last_only=True)  # compiles what decode needs
        step_times = []
        tok_id = np.array([[int(ids[0, -1])]])
        for _ in range(args.new_tokens):
            t0 = time.perf_counter()
            logits = model.forward(tok_id, cache, last_only=True)
            step_times.append(time.perf_counter() - t0)
            tok_id = np.array([[int(np.argmax(logits[0]))]])
        t_step = float(np.mean(step_times))  # the mean, as `moqe generate` reports (tokens / time)
        rows.append({"threads": threads, "policy": policy.label, "kv cache": args.kv_cache or "f32",
                     "kv rotated": cache.rotation is not None, "compiled decode": args.compiled_decode,
                     "prompt tokens": ids.shape[1], "prefill s": t_prefill, "prefill tok/s": ids.shape[1] / t_prefill,
                     "decode ms/token": t_step * 1e3, "decode tok/s": 1 / t_step,
                     "peak RSS GB": resident()["peak"] / 1e9})
    return rows
