"""``python -m toolkit.bench uqff``: load time of a UQFF bundle vs quantizing from the checkpoint.

Same process, same policy, same backend: ``load_model(checkpoint, policy)`` (streams and quantizes every
expert) against ``load_model(bundle)`` (memory-mapped, CRC-checked, no requantization), each timed as the
median of ``--reps`` loads after one warm-up (so Numba compilation is not counted for either). Also
checks the two models' logits are identical.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from ..load import load_model
from ..quant import parse_policy
from ..uqff import save_bundle
from .timing import median_seconds, print_table

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench uqff", description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--policy", default="moqe")
    ap.add_argument("--experts", default="int4,int3", help="comma-separated formats, one row each")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--no-verify", action="store_true", help="skip the CRC-32 pass when loading the bundle")
    args = ap.parse_args(argv)

    rows = []
    ids = np.array([[1, 17, 230, 5, 99]])
    for fmt in args.experts.split(","):
        policy = parse_policy(args.policy, fmt)
        with tempfile.TemporaryDirectory(prefix="uqff_bench_") as tmp:
            out = Path(tmp) / "bundle"
            save_s = median_seconds(lambda: save_bundle(args.model, out, policy, backend=args.backend), reps=1, warmup=0)
            quant_s = median_seconds(lambda: load_model(args.model, args.backend, policy), reps=args.reps, warmup=1)
            from ..uqff import load_bundle

            load_s = median_seconds(lambda: load_bundle(out, args.backend, verify=not args.no_verify),
                                    reps=args.reps, warmup=1)
            a, _ = load_model(args.model, args.backend, policy)
            b, _ = load_bundle(out, args.backend)
            same = bool(np.array_equal(a.forward(ids, a.new_cache(1, 8)), b.forward(ids, b.new_cache(1, 8))))
            size = sum(p.stat().st_size for p in out.iterdir())
        rows.append({"policy": policy.label, "quantize from checkpoint s": quant_s, "load bundle s": load_s,
                     "speed-up": quant_s / load_s, "save s": save_s, "bundle bytes": size, "identical logits": same})
    print_table(rows, f"UQFF load vs quantize-at-start on {Path(args.model).name} ({args.backend}, median of {args.reps})")
    return rows
