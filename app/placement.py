"""The Plan tab's Placement view: a format and a place (device or host) for every routed expert, under a device
and a host budget (``toolkit/quant/joint.py``, as ``moqe plan --vram --ram --trace``).

From the Plan tab's calibration, the routing of the first held-out tokens (the evaluation tokens, not the
calibration's: a trace recorded once per model and token count, shown as a heat map of layers x experts) and the
host GEMV GB/s of each candidate format (measured once per process), the planner's grid is shown as layers x
experts: each cell the expert's gate/up and down formats, coloured by gate/up's format, marked ``D`` on the device
and ``H`` on the host; beside it the expected time per token and bytes on each side against ``--n-cpu-moe N``
with one format at the same budgets. *Load and measure* loads the plan on the emulated device (``cuda-emu``), runs
a few decode steps and shows what was measured: the bytes each side holds and the bytes across the bus per step.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from toolkit.model import load_config
from toolkit.model.inspect import parameter_count
from toolkit.quant.joint import Context, Costs, measure_host_gbs, solve_joint, uniform_rules
from toolkit.quant.plan import Choice, policy_of

from . import handlers as h
from .configs import InputError
from .models import COMPUTE, view
from .plan import _eval_tokens

GOALS = ("least loss", "KLD budget", "tok/s target")
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ffbb78"]
MEASURE_STEPS = 4  # decode steps measured after loading


def _number(v, name: str, lo: float = 0.0) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(x) or x < lo:
        raise InputError(f"{name} must be a number >= {lo:g}, got {v}")
    return x


def _trace(cal, settings, cache, source, n: int, progress=None):
    """The routing of the first ``n`` held-out tokens by the full-precision model, recorded once per calibration."""
    from toolkit.quant import trace as routing

    traces = cal.__dict__.setdefault("traces", {})
    if n not in traces:
        base, _ = cache.get(source, h.FULL)
        ids = h.eval_ids(settings, base.tokenizer, n)
        with COMPUTE:
            traces[n] = routing.record(view(base, "f32"), ids, min(256, base.model.cfg.max_position_embeddings),
                                       keep_ids=True, source=f"{settings.heldout.name} tokens [0, {n})")
    return traces[n]


def _host_gbs(cal, cfg) -> dict:
    gbs = cal.__dict__.setdefault("host_gbs", {})
    if not gbs:
        with COMPUTE:
            gbs.update(measure_host_gbs(cal.sens.formats, 2 * cfg.expert_intermediate, cfg.hidden_size, seconds=0.1,
                                        min_bytes=16 << 20))
    return gbs


def solve(settings, cache, planner, source, vram_mb, ram_mb, goal, value, n_tokens, progress=None):
    """-> (calibration, config, trace, context, (formats, host, evaluation)); InputError for what cannot be planned."""
    cal, _ = planner.calibrate(settings, cache, source, progress)
    cfg = load_config(source)
    n = _eval_tokens(settings, n_tokens)
    t = _trace(cal, settings, cache, source, n, progress)
    if goal not in GOALS:
        raise InputError(f"goal must be one of {', '.join(GOALS)}, got {goal!r}")
    kld = _number(value, "the KLD budget") if goal == GOALS[1] else None
    target = _number(value, "the tok/s target", 1e-9) if goal == GOALS[2] else None
    counts = parameter_count(cfg)
    rest = 4 * (counts["attention"] + counts["other"])  # on the device, f32
    vram, ram = int(_number(vram_mb, "device MB") * 1e6), int(_number(ram_mb, "host MB") * 1e6)
    ctx = Context(cal.sens, t, cfg, Costs(host_gbs=_host_gbs(cal, cfg)), vram - rest, ram, rest)
    try:
        found = solve_joint(ctx, kld, target)
    except Exception as e:  # the planner's refusals name the budget
        raise InputError(str(e)) from None
    return cal, cfg, t, ctx, found


def _grid(cfg, fmts: dict, host: np.ndarray, formats) -> "pd.io.formats.style.Styler":
    colour = {f: PALETTE[i % len(PALETTE)] for i, f in enumerate(formats)}
    layers = sorted({i for i, _, _ in fmts})
    cells = {f"layer {i}": {f"e{e}": f"{fmts[(i, 'gate_up', e)]}/{fmts[(i, 'down', e)]} {'H' if host[i, e] else 'D'}"
                            for e in range(cfg.num_experts)} for i in layers}
    df = pd.DataFrame.from_dict(cells, orient="index")

    def style(v):
        gu = v.split("/")[0]
        return f"background-color: {colour.get(gu, '#ffffff')}; color: white; font-weight: {'bold' if v.endswith('D') else 'normal'}"

    return df.style.map(style)


def _heat(t) -> "pd.io.formats.style.Styler":
    share = t.counts / max(1, t.tokens)  # uses per token
    df = pd.DataFrame(np.round(100 * share / t.top_k, 1), index=[f"layer {i}" for i in t.layers],
                      columns=[f"e{e}" for e in range(t.experts)])
    top = max(float(df.values.max()), 1e-9)

    def shade(v):  # white (unused) to deep orange (the busiest expert of the model)
        a = float(v) / top
        r, g, b = (255, int(255 - a * (255 - 127)), int(255 - a * 255))
        return f"background-color: rgb({r}, {g}, {b}); color: {'white' if a > 0.6 else 'black'}"

    return df.style.map(shade).format("{:.1f} %")


def place(settings, cache, planner, source, vram_mb, ram_mb, goal, value, n_tokens, progress=None):
    """-> (status, the plan's grid, the routing heat map, the plan against the uniform rules)."""
    cal, cfg, t, ctx, (fmts, host, ev) = solve(settings, cache, planner, source, vram_mb, ram_mb, goal, value, n_tokens,
                                               progress)
    rules = uniform_rules(ctx)
    rows = [{"plan": "joint (this grid)", "formats": "mixed", "device MB": ev["device_bytes"] / 1e6,
             "host MB": ev["host_bytes"] / 1e6, "ms/token": 1e3 * ev["time_s"], "tok/s": ev["tok_s"],
             "predicted KLD": ev["loss"]}]
    rows += [{"plan": r["rule"], "formats": r["format"], "device MB": r["device_bytes"] / 1e6, "host MB": r["host_bytes"] / 1e6,
              "ms/token": 1e3 * r["time_s"], "tok/s": r["tok_s"], "predicted KLD": r["loss"]} for r in rules]
    c = ctx.costs
    status = (f"Joint plan: expected **{1e3 * ev['time_s']:.3f} ms/token** ({ev['tok_s']:,.0f} tok/s), predicted KLD "
              f"**{ev['loss']:.4g}**; routed experts {ev['device_bytes'] / 1e6:.3f} MB on the device, "
              f"{ev['host_bytes'] / 1e6:.3f} MB on the host ({ev['host_experts']} experts, {ev['hybrid_layers']} layers "
              f"with a hop). Model: device {c.device_gbs:g} GB/s, bus {c.bus_gbs:g} GB/s, hop {c.hop_us:g} us, host GB/s "
              f"measured here ({', '.join(f'{k} {v:.1f}' for k, v in c.host_gbs.items())}); routing of {t.tokens} "
              f"held-out tokens. D: on the device, H: on the host; colour: the gate/up format.")
    return status, _grid(cfg, fmts, host, cal.sens.formats), _heat(t), pd.DataFrame(rows)


def place_measure(settings, cache, planner, source, vram_mb, ram_mb, goal, value, n_tokens, progress=None) -> str:
    """Load the plan on the emulated device and measure what it holds and moves (a few decode steps)."""
    from toolkit.load import load_model
    from toolkit.model.placement import Places

    cal, cfg, t, ctx, (fmts, host, ev) = solve(settings, cache, planner, source, vram_mb, ram_mb, goal, value,
                                               n_tokens, progress)
    plan = {f"layers.{i}.moe.{p}.{e}": Choice(f, cal.sens.nbytes[(i, p, e)][f], cal.sens.loss[(i, p, e)][f])
            for (i, p, e), f in fmts.items()}
    with COMPUTE:
        model, tok = load_model(source, "cuda-emu", policy=policy_of(plan, cal.sens, "placement"),
                                placement=Places(host, "the joint plan"), activations=cache.activations)
        ids = h.eval_ids(settings, tok, 8)
        kv = model.new_cache(1, 8 + MEASURE_STEPS)
        model.forward(np.asarray(ids)[None, :8], kv)
        dev = model.rt.device
        before = dev.counters.snapshot()
        for s in range(MEASURE_STEPS):
            model.decode(np.array([ids[s]]), kv)
        moved = dev.counters.since(before)
    wb = model.weight_bytes()
    return (f"Measured after loading on the emulated device: routed experts **{(wb['experts'] - wb['host experts']) / 1e6:.3f} "
            f"MB on the device, {wb['host experts'] / 1e6:.3f} MB on the host** (planned {ev['device_bytes'] / 1e6:.3f} / "
            f"{ev['host_bytes'] / 1e6:.3f} MB as stored); bus per decode step: in {moved.bytes_in / MEASURE_STEPS:,.0f} B, "
            f"out {moved.bytes_out / MEASURE_STEPS:,.0f} B (the token id and, per layer with host experts, the routing "
            f"and the rows routed to them; no weight byte).")
