"""The Plan tab: one format per routed expert projection under a byte budget (``toolkit/quant/plan.py``).

Calibration (``toolkit.quant.sensitivity.calibrate``, minutes on the bundled model) runs once per model and
calibration text and is kept in this process (:class:`Planner`), so a new budget is planned at once (the
knapsack takes well under a second). Each plan is shown against the uniform formats and against planned mixes
at ``settings.plan_points`` budgets from the cheapest to the largest: expert bytes against predicted mean KLD,
and, after Measure, the KLD measured from the full-precision model on the first held-out tokens (the Measure
tab's evaluation tokens; calibration reads the tokens from ``settings.calib_start`` on).
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from toolkit.model import load_config
from toolkit.quant.plan import items_from, policy_of, save_plan, solve, uniform
from toolkit.quant.sensitivity import Sensitivity, calibrate

from . import handlers as h
from .configs import InputError, parse_count
from .models import COMPUTE, load, view
from .paths import under_root

UNITS = ("bits/weight", "MB")
BITS_RANGE = (2.25, 8.5)  # the slider: about int2-g128 .. q8_0
# the chart's series: predicted in full colour, measured in a lighter shade; this plan stands out in red
SERIES_COLORS = {"uniform (predicted)": "#1f77b4", "uniform (measured)": "#9ecae1", "planned (predicted)": "#ff7f0e",
                 "planned (measured)": "#fdd0a2", "this plan (predicted)": "#d62728", "this plan (measured)": "#e377c2"}
CHART_COLUMNS = ["configuration", "series", "expert MB", "bits/weight", "KLD", "log10 KLD"]


@dataclass
class Calibration:
    """One calibration and what was planned and measured from it."""

    sens: Sensitivity
    tag: str  # short digest of what was calibrated
    items: dict = field(init=False)  # {name: [Choice]}
    params: int = field(init=False)  # routed expert weights
    measured: dict = field(default_factory=dict)  # (policy label, eval tokens) -> perplexity's result

    def __post_init__(self):
        self.items = items_from(self.sens)
        self.params = sum(int(np.prod(s)) for s in self.sens.shapes.values())

    @property
    def floor(self) -> int:  # bytes of the cheapest format of every item
        return sum(min(c.nbytes for c in cs) for cs in self.items.values())

    @property
    def top(self) -> int:  # bytes of the largest
        return sum(max(c.nbytes for c in cs) for cs in self.items.values())

    def bits(self, nbytes: int) -> float:
        return 8 * nbytes / self.params


@dataclass(frozen=True)
class Point:
    """One configuration on the chart: a uniform format or a planned mix."""

    label: str
    kind: str  # "uniform", "planned" or "this plan"
    plan: dict  # {name: Choice or format spec}
    nbytes: int
    loss: float  # predicted mean KLD


class Planner:
    """Calibrations held by this app process, by (model, text, start, tokens, formats); the least recent dropped."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._items: OrderedDict[tuple, Calibration] = OrderedDict()

    @staticmethod
    def key(settings, source) -> tuple:
        return (str(Path(source).resolve()), str(Path(settings.heldout).resolve()), int(settings.calib_start),
                int(settings.calib_tokens), tuple(settings.calib_formats))

    def calibrate(self, settings, cache, source, progress=None) -> tuple[Calibration, bool]:
        """-> (the calibration of ``source``, whether it was already held); runs it (holding ``COMPUTE``) if not."""
        h.refuse_bundle_source(source, "plan")
        if not Path(settings.heldout).is_file():
            raise InputError(f"no calibration text at {settings.heldout}")
        key = self.key(settings, source)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key], True
        h.note_first_use(cache, progress)
        cfg = load_config(source)
        steps = h._Steps(progress, sum(map(bool, cfg.moe_layers)) * cfg.num_experts, "calibrating experts")
        with COMPUTE:  # also keeps two sessions from calibrating one key twice
            if key in self._items:
                return self._items[key], True
            sens = calibrate(source, settings.heldout, start=settings.calib_start, tokens=settings.calib_tokens,
                             formats=settings.calib_formats, backend=_host_backend(cache), progress=steps)
            cal = Calibration(sens, hashlib.sha256(repr(key).encode()).hexdigest()[:8])
            self._items[key] = cal
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return cal, False


def _host_backend(cache) -> str:
    """Calibration runs on the CPU: numpy when the app runs numpy, else numba."""
    return "numpy" if getattr(cache, "backend", "numba") == "numpy" else "numba"


# ---- inputs -----------------------------------------------------------------------------------------------
def parse_budget(cal: Calibration, unit, bits, mb) -> int:
    """The page's budget -> bytes of routed experts; InputError (naming the smallest plan) when it cannot fit."""
    if unit not in UNITS:
        raise InputError(f"budget unit must be one of {', '.join(UNITS)}, got {unit!r}")
    value, name = (bits, "bits per weight") if unit == UNITS[0] else (mb, "budget in MB")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v <= 0 or v > (32 if unit == UNITS[0] else 1e7):
        raise InputError(f"{name} must be a positive number{' up to 32' if unit == UNITS[0] else ''}, got {value}")
    budget = int(v * cal.params / 8) if unit == UNITS[0] else int(v * 1e6)
    if budget < cal.floor:
        raise InputError(f"a budget of {budget / 1e6:.3f} MB ({cal.bits(budget):.2f} bits/weight) is too small: the "
                         f"smallest formats of every expert projection take {cal.floor / 1e6:.3f} MB "
                         f"({cal.bits(cal.floor):.2f} bits/weight)")
    return budget


def _bytes(plan: dict) -> int:
    return sum(c.nbytes for c in plan.values())


def _loss(plan: dict) -> float:
    return sum(c.loss for c in plan.values())


def points(cal: Calibration, budget: int, n_planned: int) -> list[Point]:
    """The uniform formats, planned mixes at ``n_planned`` budgets from the cheapest to the largest, and the plan
    at ``budget`` (last)."""
    out = []
    for f in cal.sens.formats:
        b, loss = uniform(cal.items, f)
        out.append(Point(f"uniform {f}", "uniform", {n: f for n in cal.items}, b, loss))
    for b in np.linspace(cal.floor, cal.top, max(2, n_planned)).astype(np.int64):
        plan = solve(cal.items, int(b))
        out.append(Point(f"plan @ {cal.bits(_bytes(plan)):.2f} bits", "planned", plan, _bytes(plan), _loss(plan)))
    plan = solve(cal.items, budget)
    out.append(Point(f"this plan @ {cal.bits(_bytes(plan)):.2f} bits", "this plan", plan, _bytes(plan), _loss(plan)))
    return out


def _policy(cal: Calibration, p: Point, label: str = "plan"):
    return policy_of(p.plan, cal.sens, label)


# ---- outputs ----------------------------------------------------------------------------------------------
def _outputs(cal: Calibration, pts: list[Point], n_tokens: int | None, note: str = ""):
    """-> (status, the plan's table, every point's table, the chart's frame)."""
    cur = pts[-1]
    measured = {p.label: cal.measured.get((_policy(cal, p).label, n_tokens)) for p in pts} if n_tokens else {}
    rows, chart = [], []
    for p in pts:
        r = measured.get(p.label)
        rows.append({"configuration": p.label, "kind": p.kind, "expert MB": round(p.nbytes / 1e6, 3),
                     "bits/weight": round(cal.bits(p.nbytes), 3), "predicted KLD": float(f"{p.loss:.4g}"),
                     "measured KLD": float(f"{r['kld_mean']:.4g}") if r else "-",
                     "perplexity": round(r["perplexity"], 3) if r else "-",
                     "top-1 agree %": round(100 * r["top1_agreement"], 2) if r else "-"})
        for how, kld in (("predicted", p.loss), ("measured", r["kld_mean"] if r else None)):
            if kld is not None:
                chart.append({"configuration": p.label, "series": f"{p.kind} ({how})", "expert MB": p.nbytes / 1e6,
                              "bits/weight": cal.bits(p.nbytes), "KLD": kld, "log10 KLD": math.log10(max(kld, 1e-12))})
    counts: dict[str, dict] = {}
    for name, c in cur.plan.items():
        row = counts.setdefault(c.fmt, {"format": c.fmt, "gate_up": 0, "down": 0, "bytes": 0, "predicted KLD": 0.0})
        row["gate_up" if ".gate_up." in name else "down"] += 1
        row["bytes"] += c.nbytes
        row["predicted KLD"] += c.loss
    order = {f: i for i, f in enumerate(cal.sens.formats)}
    plan_rows = [{**r, "expert projections": r["gate_up"] + r["down"], "MB": round(r["bytes"] / 1e6, 3),
                  "bits/weight": round(cal.bits(r["bytes"]), 3), "predicted KLD": float(f"{r['predicted KLD']:.4g}")}
                 for r in sorted(counts.values(), key=lambda r: order.get(r["format"], 99))]
    plan_rows.append({"format": "total", "gate_up": sum(r["gate_up"] for r in plan_rows),
                      "down": sum(r["down"] for r in plan_rows), "bytes": cur.nbytes,
                      "expert projections": len(cur.plan), "MB": round(cur.nbytes / 1e6, 3),
                      "bits/weight": round(cal.bits(cur.nbytes), 3), "predicted KLD": float(f"{cur.loss:.4g}")})
    cols = ["format", "expert projections", "gate_up", "down", "MB", "bits/weight", "predicted KLD"]
    r = measured.get(cur.label)
    status = (f"Plan: **{cur.nbytes / 1e6:.3f} MB** of routed experts ({cal.bits(cur.nbytes):.3f} bits/weight), "
              f"predicted mean KLD **{cur.loss:.4g}**" + (f", measured **{r['kld_mean']:.4g}**" if r else "") +
              f" · calibration: {cal.sens.calibration}" + (f" · {note}" if note else ""))
    return status, pd.DataFrame(plan_rows, columns=cols), pd.DataFrame(rows), pd.DataFrame(chart, columns=CHART_COLUMNS)


# ---- the endpoints ----------------------------------------------------------------------------------------
def plan_calibrate(settings, cache, planner: Planner, source, progress=None) -> str:
    cal, held = planner.calibrate(settings, cache, source, progress)
    s = cal.sens
    forced = sum(1 for x in s.stats.values() if x.forced)
    return (f"{'Already calibrated' if held else 'Calibrated'}: {len(s.loss)} expert projections at "
            f"{len(s.formats)} formats ({', '.join(s.formats)}) on {s.calibration}; {forced} expert(s) measured on "
            f"tokens forced through them. Pick a budget and press Plan.")


def plan(settings, cache, planner: Planner, source, unit, bits, mb, n_tokens=None, progress=None):
    """-> (status, plan table, points table, chart); calibrates first when this model was not calibrated yet.
    ``n_tokens``: the Measure box (points measured at that many held-out tokens are shown)."""
    cal, _ = planner.calibrate(settings, cache, source, progress)
    try:  # the points measured before at this many tokens are shown too
        n = _eval_tokens(settings, n_tokens)
    except InputError:
        n = None
    return _outputs(cal, points(cal, parse_budget(cal, unit, bits, mb), settings.plan_points), n)


def _eval_tokens(settings, n_tokens) -> int:
    # the first held-out tokens, disjoint from the calibration tokens
    return parse_count(n_tokens, "held-out tokens", 16, min(65536, settings.calib_start))


def plan_measure(settings, cache, planner: Planner, source, unit, bits, mb, n_tokens, progress=None):
    """Measure the KLD (from the full-precision model) and perplexity of every point on the chart."""
    cal, _ = planner.calibrate(settings, cache, source, progress)
    n = _eval_tokens(settings, n_tokens)
    pts = points(cal, parse_budget(cal, unit, bits, mb), settings.plan_points)
    todo = {}
    for p in pts:
        pol = _policy(cal, p)
        if (pol.label, n) not in cal.measured:
            todo.setdefault(pol.label, (p, pol))
    h.note_first_use(cache, progress)
    base, _ = cache.get(source, h.FULL)
    reference = view(base, "f32")
    ids = h.eval_ids(settings, base.tokenizer, n)
    steps = h._Steps(progress, h.eval_windows(settings, n) * max(1, len(todo)), "measuring KLD")
    for label, (p, pol) in todo.items():
        steps.desc = f"KLD of {p.label}"
        with COMPUTE:
            loaded = load(source, pol, cache.backend, cache.activations)
        r, _ = h.score(settings, view(loaded, "f32"), ids, reference, steps)
        cal.measured[(label, n)] = r
        del loaded
    note = f"measured {len(todo)} configuration(s) on the first {n} held-out tokens" if todo else "already measured"
    return _outputs(cal, pts, n, note)


def plan_save(settings, cache, planner: Planner, source, unit, bits, mb, name, progress=None):
    """Write the plan's UQFF bundle under the output root, its plan file beside it (``NAME.plan``, with the
    calibrated scales in ``NAME.plan.imatrix.safetensors`` when it uses any) -> (message, bundle picker)."""
    cal, _ = planner.calibrate(settings, cache, source, progress)
    cur = points(cal, parse_budget(cal, unit, bits, mb), 0)[-1]
    out = under_root(settings.output_root, name)
    plan_path = out.parent / f"{out.name}.plan"
    imatrix_path = out.parent / f"{plan_path.name}.imatrix.safetensors"
    _check_replaceable(plan_path, imatrix_path)
    policy = policy_of(cur.plan, cal.sens, plan_path.name)
    out, msg = h.write_bundle(settings, cache, source, policy, name, progress)
    header = [(f"moqe plan (app): {source}, budget of routed experts {cur.nbytes:,} bytes "
               f"({cal.bits(cur.nbytes):.3f} bits/weight), predicted mean KLD {cur.loss:.6g}"),
              f"calibration: {cal.sens.calibration}", f"bundle: {out.name}",
              "one line per routed expert projection: layers.LAYER.moe.{gate_up,down}.EXPERT=FORMAT"]
    save_plan(plan_path, cur.plan, cal.sens, header)
    return (f"{msg} Plan file **{plan_path.name}** beside it ({cal.bits(cur.nbytes):.3f} bits/weight, predicted mean "
            f"KLD {cur.loss:.4g}). Press *Load it for Compare* (or Load bundle in Quantize & save) to run it, "
            f"with expert format `none`."), h.bundle_choices(settings, out)


def _check_replaceable(*paths: Path) -> None:
    """The plan file (and its scales) beside a bundle replace only files this toolkit wrote: the write rule
    (:func:`toolkit.writes.check_file_target`), as for ``moqe plan --out``; the app has no --force."""
    from toolkit.writes import WriteError, check_file_target

    plan, scales = paths
    for p, kind in ((plan, "plan"), (scales, "imatrix")):
        if not p.parent.is_dir():  # a new folder: the bundle's save makes it, and nothing is there to replace
            continue
        try:
            check_file_target(p, kind)
        except WriteError as e:
            raise InputError(f"{p.name} beside the bundle: {str(e).split(': ', 1)[-1]} (choose another bundle name)") from None
    if scales.exists() and not plan.exists():
        raise InputError(f"{scales.name} beside the bundle belongs to no plan file; it is kept (choose another "
                         f"bundle name)")
