"""``moqe plan --vram GB --ram GB --trace FILE [--budget-kld X | --target TOK/S]``: the joint planner's command
(``toolkit/quant/joint.py``): checks, host GB/s, the plan, and its comparison with the uniform rule."""
from __future__ import annotations

import numpy as np

from ..errors import ToolkitError
from .joint import BUS_GBS, DEVICE_GBS, HOP_US, Context, Costs, solve_joint, uniform_rules


def check_joint_args(args):
    """The joint flags checked before anything is measured; returns the loaded trace."""
    from . import trace as routing

    t = routing.load(args.trace) if args.trace is not None else None  # a bad trace is named first
    missing = [f for f, v in (("--vram", args.vram), ("--ram", args.ram), ("--trace", args.trace)) if v is None]
    if missing:
        raise ToolkitError(f"planning formats and places together needs --vram GB, --ram GB and --trace FILE; "
                           f"missing {', '.join(missing)}")
    if args.budget_mb is not None or args.bits_per_weight is not None:
        raise ToolkitError("--vram and --ram are the budgets of a joint plan; drop --budget-mb / --bits-per-weight")
    if args.budget_kld is not None and args.target is not None:
        raise ToolkitError("give one of --budget-kld X (least time within a loss) or --target TOK/S (least loss at a speed)")
    return t


def _host_gbs(text, formats, cfg) -> dict:
    if text:
        out = {}
        for part in text.split(","):
            f, sep, v = part.partition("=")
            try:
                out[f.strip()] = float(v)
            except ValueError:
                sep = ""
            if not sep or out.get(f.strip(), 0) <= 0:
                raise ToolkitError(f"--host-gbs: {part!r} must look like FORMAT=GB/S with GB/S > 0 (e.g. q4_0=40)")
        missing = [f for f in formats if f not in out]
        if missing:
            raise ToolkitError(f"--host-gbs names no rate for {', '.join(missing)} (the candidate formats: {', '.join(formats)})")
        return out
    from .joint import measure_host_gbs

    return measure_host_gbs(formats, 2 * cfg.expert_intermediate, cfg.hidden_size)


def check_trace(t, cfg, where) -> None:
    moe = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    if list(t.layers) != moe or t.experts != cfg.num_experts or t.top_k != cfg.top_k:
        raise ToolkitError(f"{where}: traced MoE layers {list(t.layers)}, {t.experts} experts, top-{t.top_k}; the model has "
                           f"MoE layers {moe}, {cfg.num_experts} experts, top-{cfg.top_k}")


def plan_joint(args, cfg, sens, t):
    """(plan ``{name: Choice}``, header lines, host mask ``[L, E]``); prints the plan against the uniform rule."""
    from ..bench.timing import print_table
    from ..model.inspect import parameter_count
    from .plan import Choice

    costs = Costs(args.device_gbs or DEVICE_GBS, args.bus_gbs or BUS_GBS, HOP_US if args.hop_us is None else args.hop_us,
                  _host_gbs(args.host_gbs, sens.formats, cfg))
    counts = parameter_count(cfg)
    rest = 4 * (counts["attention"] + counts["other"])  # on the device, f32 (the CUDA kernels' dense weights)
    ctx = Context(sens, t, cfg, costs, int(args.vram * 1e9) - rest, int(args.ram * 1e9), rest)
    fmts, host, ev = solve_joint(ctx, args.budget_kld, args.target)
    rules = uniform_rules(ctx)

    def row(name, fmt, e):
        return {"plan": name, "formats": fmt, "device GB": e["device_bytes"] / 1e9, "host GB": e["host_bytes"] / 1e9,
                "experts on the host": e["host_experts"], "layers with a hop": e["hybrid_layers"],
                "ms/token": 1e3 * e["time_s"], "tok/s": e["tok_s"], "predicted loss": e["loss"]}

    mix = ", ".join(f"{f} {n}" for f, n in sorted({f: list(fmts.values()).count(f) for f in set(fmts.values())}.items()))
    rows = [row("joint", mix, ev)] + [row(r["rule"], r["format"], r) for r in rules]
    unit = "predicted mean KLD, nats" if sens.factors else "summed squared output error"
    print_table(rows, f"expected decode time per token (bandwidth model: device {costs.device_gbs:g} GB/s, bus {costs.bus_gbs:g} "
                      f"GB/s, hop {costs.hop_us:g} us; host GB/s {', '.join(f'{k} {v:.1f}' for k, v in costs.host_gbs.items())}) "
                      f"and loss ({unit}); routing from {args.trace} ({t.tokens} tokens)")
    if rules:  # the uniform rule holding the most bytes within the same budgets: the closest to the plan's
        r = max(rules, key=lambda r: (r["device_bytes"] + r["host_bytes"], -r["loss"]))
        ratio = (ev["device_bytes"] + ev["host_bytes"]) / max(1, r["device_bytes"] + r["host_bytes"])
        verdict = ("beats it on both" if ev["time_s"] <= r["time_s"] and ev["loss"] <= r["loss"] else
                   "is faster, with more loss" if ev["time_s"] <= r["time_s"] else
                   "has less loss, and is slower" if ev["loss"] <= r["loss"] else "loses on both")
        print(f"against the uniform rule that holds the most bytes within the same budgets ({r['rule']}, {r['format']}; the plan "
              f"holds {ratio:.3f}x its bytes): the joint plan {verdict} ({1e3 * ev['time_s']:.3f} vs {1e3 * r['time_s']:.3f} "
              f"ms/token, loss {ev['loss']:.4g} vs {r['loss']:.4g})")
    else:
        print("no uniform rule fits these budgets (every --n-cpu-moe N with one format everywhere exceeds one of them)")
    plan = {f"layers.{i}.moe.{p}.{e}": Choice(f, sens.nbytes[(i, p, e)][f], sens.loss[(i, p, e)][f]) for (i, p, e), f in fmts.items()}
    header = [f"moqe plan: {args.model}, formats and places for --vram {args.vram:g} GB, --ram {args.ram:g} GB"
              + (f", --budget-kld {args.budget_kld:g}" if args.budget_kld is not None else "")
              + (f", --target {args.target:g} tok/s" if args.target is not None else ""),
              f"calibration: {sens.calibration}; routing: {args.trace} ({t.tokens} tokens)",
              f"expected {1e3 * ev['time_s']:.4f} ms/token, predicted loss {ev['loss']:.6g}, device {ev['device_bytes']:,} bytes of "
              f"experts, host {ev['host_bytes']:,}",
              "one line per routed expert projection: layers.LAYER.moe.{gate_up,down}.EXPERT=FORMAT PLACE"]
    return plan, header, np.asarray(host)
