"""``python -m toolkit.bench plan``: planned expert mixes against uniform formats, bytes against KLD.

Calibrates once (``moqe plan``'s sensitivity: the held-out text's tokens from 8,192 on), then evaluates on
the held-out text's first 8,192 tokens (never seen by calibration), against the full-precision model, in one
process: every uniform format (round-to-nearest, the MoQE policy) and the planned mix at each budget, among
them the two the issue names: the bytes of uniform int3-g64, and 85 % of uniform int4-g128's bytes.
``uniform+cal`` rows: a uniform format with the same calibrated scales a plan uses (the scale search of
``toolkit/quant/imatrix.py`` where it measured better), so the plan's gain from allocation is told apart from
its gain from calibration. Columns: routed-expert bytes and bits per weight, predicted KLD (the planner's), measured KLD (mean, p99),
top-1 agreement, perplexity. ``--json`` keeps the rows (the app's Plan tab reads the same fields).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..load import load_model
from ..model import perplexity
from ..quant import QuantReport, parse_policy
from ..quant.plan import items_from, policy_of, rtn_loss, solve, uniform
from ..quant.sensitivity import CALIBRATION_START, CALIBRATION_TOKENS, calibrate
from .timing import print_table

ROOT = Path(__file__).resolve().parents[2]
UNIFORM = ["int8", "int4-g64", "int4-g128", "q4_0", "int3-g32", "int3-g64", "int3-g128", "int2-g64"]
# planned budgets: named by a uniform format's bytes (times a factor), or a number of bits per weight
CALIBRATED = ["int4-g128", "int3-g64"]  # uniform, with the calibrated scales a plan uses: the fair comparison
BUDGETS = ["int3-g64", "0.85*int4-g128", "int2-g64", "3.0", "3.25", "3.75", "4.0", "int4-g128"]


def budget_bytes(spec: str, items: dict, params: int) -> int:
    """``int3-g64`` (that format's uniform bytes), ``0.85*int4-g128``, or ``3.5`` (bits per weight)."""
    factor, _, name = spec.rpartition("*")
    if name[:1].isdigit():
        return int(float(factor or 1) * float(name) * params / 8)
    return int(float(factor or 1) * uniform(items, name)[0])


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--text", default=str(ROOT / "data" / "heldout.txt"))
    ap.add_argument("--uniform", default=",".join(UNIFORM))
    ap.add_argument("--calibrated", default=",".join(CALIBRATED),
                    help="uniform formats also run with the plan's calibrated scales (where they measured better)")
    ap.add_argument("--budgets", default=",".join(BUDGETS),
                    help="planned budgets: a format (its uniform bytes), FACTOR*FORMAT, or bits per weight")
    ap.add_argument("--max-tokens", type=int, default=8192, help="evaluate on the first N held-out tokens")
    ap.add_argument("--calib-start", type=int, default=CALIBRATION_START)
    ap.add_argument("--calib-tokens", type=int, default=CALIBRATION_TOKENS)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--json", default=None, metavar="OUT.json", help="also write the rows")
    args = ap.parse_args(argv)
    if args.max_tokens > args.calib_start:
        ap.error(f"--max-tokens {args.max_tokens} would evaluate on calibration tokens (from {args.calib_start})")

    t0 = time.perf_counter()
    with tqdm(desc="calibrating", unit="expert") as bar:
        sens = calibrate(args.model, args.text, args.calib_start, args.calib_tokens, progress=bar)
    t_cal = time.perf_counter() - t0
    items = items_from(sens)
    params = sum(int(np.prod(s)) for s in sens.shapes.values())
    configs = [("none", "-", parse_policy("none"), 0.0)]
    for f in filter(None, args.uniform.split(",")):
        configs.append(("uniform", f, parse_policy("moqe", f), rtn_loss(sens, f)))
    for f in filter(None, args.calibrated.split(",")):
        configs.append(("uniform+cal", f, policy_of({n: f for n in items}, sens, f"uniform-{f}"), uniform(items, f)[1]))
    for b in filter(None, args.budgets.split(",")):
        plan = solve(items, budget_bytes(b, items, params))
        configs.append(("plan", f"<= {b}", policy_of(plan, sens, f"plan-{b}"), sum(c.loss for c in plan.values())))

    rows, ids, reference = [], None, None
    for kind, what, policy, predicted in tqdm(configs, desc="configurations"):
        report = QuantReport(policy.label)
        model, tok = load_model(args.model, policy=policy, report=report)
        if ids is None:
            ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))[: args.max_tokens]
        reference = reference or model
        r = perplexity(model, ids, args.window, args.stride, reference=reference)
        expert = [x for x in report.rows if x["role"] in ("moe.gate_up", "moe.down")]
        nbytes = sum(x["bytes"] for x in expert)
        rows.append({"kind": kind, "configuration": what, "expert MB": nbytes / 1e6, "bits/weight": 8 * nbytes / params,
                     "predicted KLD": predicted, "KLD mean": r["kld_mean"], "KLD p99": r["kld_p99"],
                     "top-1 agree": f"{100 * r['top1_agreement']:.2f} %", "perplexity": r["perplexity"]})
    print_table(rows, f"planned expert mixes vs uniform formats on {Path(args.model).name}: calibrated on "
                      f"{sens.calibration} in {t_cal:.0f} s; evaluated on the first {len(ids)} tokens of "
                      f"{Path(args.text).name} (window {args.window} stride {args.stride}); KLD = KL(full precision || "
                      f"configuration) per token, nats; predicted KLD = the planner's sum over expert projections")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows
