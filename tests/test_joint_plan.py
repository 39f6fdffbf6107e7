"""The joint planner (``toolkit/quant/joint.py``): a format and a place for every routed expert under a VRAM and a
RAM budget, from routing (a trace) and sensitivity; and the plan file's place column that ``--plan`` applies.

- The time model by hand on a small case; P(a token touches a host set) from pair counts equal to the per-token
  count (top-2).
- The search as a table of budgets: both memory budgets held, the loss budget or the speed target met, the busiest
  experts on the device; on skewed routing it beats ``--n-cpu-moe N`` with one format at the same budgets on both
  time and loss; what cannot be met is refused, naming the budget.
- Plan files: the place column round-trips; a bad place, a partial column, the two projections of an expert on two
  sides are refused naming the line; ``--plan`` places experts on the emulated device, and its places are ignored
  on the CPU backend, where every expert is on the host.
- ``moqe plan --vram --ram --trace`` end to end on a tiny checkpoint, then ``moqe generate --plan`` with its places.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from test_plan import cli, full_plan  # noqa: F401 (fixtures)
from toolkit.cli import main
from toolkit.errors import ToolkitError
from toolkit.formats import get_format
from toolkit.model.placement import PlacementSpec, layer_bus_bytes, resolve_places
from toolkit.quant.joint import Context, Costs, evaluate, solve_joint, uniform_rules
from toolkit.quant.plan import parse_plan, plan_places, plan_text
from toolkit.quant.sensitivity import Sensitivity
from toolkit.quant.trace import Trace, add_tokens

FORMATS = ("q8_0", "q4_0", "int2-g64")
D, I, E, A = 64, 64, 8, 2
# Mixtral's proportions at this toy size: a q4_0 expert of Mixtral (88 MB) reads in ~44 us on a device at 2 TB/s
# and ~9 ms on a host at 10 GB/s, against a 15 us hop; these experts are ~2,200x smaller, and so are the bandwidths
COSTS = dict(device_gbs=0.9, bus_gbs=25.0, hop_us=15.0, host_gbs={"q8_0": 0.0045, "q4_0": 0.004, "int2-g64": 0.0025})


def _cfg(L=3):
    return SimpleNamespace(num_layers=L, num_experts=E, top_k=A, hidden_size=D, expert_intermediate=I,
                           moe_layers=[True] * L)


def _sens(L=3, seed=0):
    """Losses: fewer bits, more loss; each expert's loss scaled by a random weight (as calibration scales it)."""
    rng = np.random.default_rng(seed)
    s = Sensitivity("m", "text", 100, FORMATS)
    base = {"q8_0": 1e-4, "q4_0": 2e-3, "int2-g64": 4e-2}
    for i in range(L):
        for e in range(E):
            w = rng.uniform(0.2, 1.0)
            for p, shape in (("gate_up", (2 * I, D)), ("down", (D, I))):
                s.shapes[(i, p, e)] = list(shape)
                s.loss[(i, p, e)] = {f: w * base[f] for f in FORMATS}
                s.nbytes[(i, p, e)] = {f: get_format(f).nbytes(shape) for f in FORMATS}
    return s


def _trace(L=3, T=2000, skew=2.0, seed=1, ids=True):
    """Top-2 routing with Zipf-like expert popularity (``skew``; 0: even)."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, E + 1) ** skew
    counts, pairs, all_ids = np.zeros((L, E), np.int64), np.zeros((L, E, E), np.int64), np.zeros((L, T, A), np.int32)
    for j in range(L):
        perm = rng.permutation(E)  # a different hot set per layer
        for t in range(T):
            all_ids[j, t] = perm[rng.choice(E, A, replace=False, p=p / p.sum())]
        add_tokens(counts[j], pairs[j], all_ids[j])
    return Trace(tuple(range(L)), counts, pairs, T, A, all_ids if ids else None)


def _ctx(vram, ram, L=3, rest=1000, costs=None, trace=None):
    return Context(_sens(L), trace or _trace(L), _cfg(L), costs or Costs(**COSTS), vram, ram, rest)


def _bytes(f):
    return get_format(f).nbytes((2 * I, D)) + get_format(f).nbytes((D, I))


def test_the_time_model_by_hand():
    """One layer, experts 0 and 1 on the host at q4_0, the rest on the device at q8_0."""
    ctx = _ctx(10**9, 10**9, L=1)
    host = np.zeros((1, E), bool)
    host[0, :2] = True
    fmts = {(0, p, e): ("q4_0" if e < 2 else "q8_0") for p in ("gate_up", "down") for e in range(E)}
    ev = evaluate(ctx, fmts, host)
    s = ctx.trace.counts[0] / ctx.trace.tokens  # uses per token
    t_dev = sum(s[e] * _bytes("q8_0") for e in range(2, E)) / 0.9e9
    touch = float(host[0][ctx.trace.ids[0]].any(1).mean())
    bus = layer_bus_bytes(1, 1, D, A)
    t_host = (sum(s[e] * _bytes("q4_0") for e in range(2)) / 0.004e9 + 15e-6
              + (2 * A * 4 + touch * (bus["out"] + bus["in"] - 2 * A * 4)) / 25e9)
    assert ev["time_s"] == pytest.approx(1000 / 0.9e9 + max(t_dev, t_host), rel=1e-12)
    assert ev["device_bytes"] == 6 * _bytes("q8_0") and ev["host_bytes"] == 2 * _bytes("q4_0")
    assert ev["loss"] == pytest.approx(sum(ctx.loss(0, p, e, fmts[(0, p, e)]) for (_, p, e) in fmts))


@pytest.mark.parametrize("host_set", [[0], [0, 3], [1, 2, 5, 7], list(range(E))])
def test_touch_from_pairs_equals_the_per_token_count_at_top_2(host_set):
    with_ids = _ctx(0, 0)
    without = _ctx(0, 0, trace=_trace(ids=False))
    h = np.isin(np.arange(E), host_set)
    for i in range(3):
        assert without.touch(i, h) == pytest.approx(with_ids.touch(i, h), abs=1e-12)


ONE = _bytes("q8_0")
# (VRAM bytes for experts, RAM bytes, budget_kld, target tok/s): budgets that force a split, loose and tight
BUDGETS = [(6 * ONE, 20 * ONE, None, None), (12 * ONE, 4 * ONE, None, None), (3 * ONE, 8 * ONE, None, None),
           (6 * ONE, 20 * ONE, 0.2, None), (2 * ONE, 30 * ONE, None, 15.0), (24 * ONE, 0, None, None)]


@pytest.mark.parametrize("vram,ram,kld,target", BUDGETS)
def test_the_plan_holds_both_budgets_and_meets_its_goal(vram, ram, kld, target):
    ctx = _ctx(vram, ram)
    fmts, host, ev = solve_joint(ctx, kld, target)
    assert ev == evaluate(ctx, fmts, host)
    assert ev["device_bytes"] <= vram and ev["host_bytes"] <= ram
    assert set(fmts.values()) <= set(FORMATS) and len(fmts) == 3 * 2 * E
    if kld is not None:
        assert ev["loss"] <= kld
    if target is not None:
        assert ev["tok_s"] >= target
    if ram == 0:
        assert not host.any()


def test_the_busiest_experts_go_to_the_device():
    """One format only: the device holds, per byte, the experts with the most uses per token."""
    ctx = _ctx(5 * _bytes("q4_0"), 10**9)
    ctx.sens.formats = ("q4_0",)
    _, host, _ = solve_joint(ctx)
    share = ctx.trace.counts / ctx.trace.tokens
    on_dev = share[~host[:3]]
    assert len(on_dev) == 5 and on_dev.min() >= share[host[:3]].max()


@pytest.mark.parametrize("vram_experts,ram_experts", [(8, 24), (12, 16), (16, 8)])
def test_the_plan_beats_the_uniform_rule_at_the_same_budgets(vram_experts, ram_experts):
    """Skewed routing, budgets holding ``vram_experts`` q8_0 experts on the device and ``ram_experts`` on the host:
    against every ``--n-cpu-moe N`` with one format that fits, the joint plan within that rule's loss is at least as
    fast, and the joint plan at that rule's speed loses no more; and at least one rule is strictly beaten on both."""
    ctx = _ctx(vram_experts * ONE, ram_experts * ONE)
    rules = uniform_rules(ctx)
    assert rules
    strictly = 0
    for r in rules:
        _, _, fast = solve_joint(ctx, budget_kld=r["loss"])
        _, _, good = solve_joint(ctx, target_tok_s=r["tok_s"])
        assert fast["time_s"] <= r["time_s"] * (1 + 1e-9) and fast["loss"] <= r["loss"], (r["rule"], r["format"])
        assert good["loss"] <= r["loss"] * (1 + 1e-9) and good["tok_s"] >= r["tok_s"], (r["rule"], r["format"])
        strictly += fast["time_s"] < r["time_s"] and good["loss"] < r["loss"]
    assert strictly


def test_what_cannot_be_met_is_refused_naming_the_budget():
    with pytest.raises(ToolkitError, match=r"the rest of the model .* needs 0\.000001 GB of the device"):
        solve_joint(_ctx(-1, 10**9))
    with pytest.raises(ToolkitError, match=r"no plan reaches a predicted loss within 1e-06"):
        solve_joint(_ctx(4 * ONE, 40 * ONE), budget_kld=1e-6)
    with pytest.raises(ToolkitError, match=r"no plan reaches the routed experts within"):
        solve_joint(_ctx(ONE, ONE))  # not even the smallest formats fit


# ---- the plan file's place column -------------------------------------------------------------------------------
def _placed_text(cfg, host):
    return plan_text(full_plan(cfg, "q4_0"), ["test"], host=host)


def test_the_place_column_round_trips(cli):  # noqa: F811
    cfg = cli["cfg"]
    host = np.zeros((cfg.num_layers, cfg.num_experts), bool)
    host[0, [1, 3]] = host[1, 0] = True
    text = _placed_text(cfg, host)
    assert "layers.0.moe.down.1=q4_0 host" in text and "layers.1.moe.gate_up.2=q4_0 device" in text
    assert {f.spec for f in parse_plan(text, cfg).values()} == {"q4_0"}
    np.testing.assert_array_equal(plan_places(text, cfg), host)
    assert plan_places(plan_text(full_plan(cfg, "q4_0"), ["test"]), cfg) is None  # no column: no places


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace("layers.0.moe.down.1=q4_0 host", "layers.0.moe.down.1=q4_0 gpu"),
     r"line \d+: 'layers\.0\.moe\.down\.1=q4_0 gpu': the place column must be host or device, not 'gpu'"),
    (lambda t: t.replace("layers.0.moe.down.1=q4_0 host", "layers.0.moe.down.1=q4_0"),
     r"15 of 16 lines have a place column; give one on every line or none"),
    (lambda t: t.replace("layers.0.moe.down.1=q4_0 host", "layers.0.moe.down.1=q4_0 device"),
     r"line \d+: expert 1 of layer 0 is placed on the host here and on the device on line \d+"),
])
def test_a_bad_place_column_is_refused_naming_the_line(cli, edit, message):  # noqa: F811
    cfg = cli["cfg"]
    host = np.zeros((cfg.num_layers, cfg.num_experts), bool)
    host[0, 1] = True
    with pytest.raises(ToolkitError, match=message):
        plan_places(edit(_placed_text(cfg, host)), cfg)


def test_plan_places_apply_on_a_device_and_are_ignored_on_the_cpu(cli, tmp_path):  # noqa: F811
    cfg = cli["cfg"]
    host = np.zeros((cfg.num_layers, cfg.num_experts), bool)
    host[1, 2] = True
    (tmp_path / "p.plan").write_text(_placed_text(cfg, host))
    spec = PlacementSpec(plan=str(tmp_path / "p.plan"))
    np.testing.assert_array_equal(resolve_places(spec, cfg, "cuda-emu").host, host)
    assert resolve_places(spec, cfg, "numba") is None
    with pytest.raises(ToolkitError, match=r"--plan \S+p\.plan places every expert \(its place column\); drop --cpu-moe"):
        resolve_places(PlacementSpec(cpu_moe=True, plan=str(tmp_path / "p.plan")), cfg, "cuda-emu")
    (tmp_path / "f.plan").write_text(plan_text(full_plan(cfg, "q4_0"), ["test"]))  # formats only: the flags place
    got = resolve_places(PlacementSpec(n_cpu_moe=1, plan=str(tmp_path / "f.plan")), cfg, "cuda-emu")
    assert got.host[0].all() and not got.host[1].any()


# ---- end to end -------------------------------------------------------------------------------------------------
def test_cli_plans_formats_and_places_then_generate_applies_them(cli, capsys):  # noqa: F811
    d, ckpt = cli["dir"], cli["ckpt"]
    assert cli["rc"] == 0
    assert main(["trace", "--model", str(ckpt), "--text", str(d / "t.txt"), "--out", str(d / "t.trace"), "--ids"]) == 0
    from toolkit.model.inspect import parameter_count

    c = parameter_count(cli["cfg"])
    rest = 4 * (c["attention"] + c["other"])
    one = _bytes("int4-g32")  # D = I = 64 here too
    argv = ["plan", "--model", str(ckpt), "--reuse", str(d / "s.json"), "--trace", str(d / "t.trace"),
            "--vram", str((rest + 3 * one) / 1e9), "--ram", str(6 * one / 1e9), "--host-gbs", "int8=9,int4-g32=7,int2-g64=4",
            "--out", str(d / "j.plan")]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert any(l.replace(" ", "").startswith("|joint|") for l in out.splitlines())
    text = (d / "j.plan").read_text()
    host = plan_places(text, cli["cfg"])
    assert host is not None and 0 < host.sum() and (~host).sum() > 0
    plan = parse_plan(text, cli["cfg"])
    dev_bytes = sum(f.nbytes((2 * I, D) if ".gate_up." in n else (D, I)) for n, f in plan.items()
                    if not host[int(n.split(".")[1]), int(n.split(".")[-1])])
    assert dev_bytes <= 3 * one + 1 and "against the uniform rule" in out
    # loaded on the emulated device (this checkpoint's head dim 16 is below the CUDA attention's 32: no forward),
    # the plan's host experts are the model's; on the CPU backend the same plan generates, its places ignored
    from toolkit.load import load_model
    from toolkit.quant.plan import plan_policy

    m, _ = load_model(ckpt, "cuda-emu", policy=plan_policy(d / "j.plan", cli["cfg"]),
                      placement=PlacementSpec(plan=str(d / "j.plan")), activations="f32")
    for i, layer in enumerate(m.layers):
        split = getattr(layer.ffn.experts, "host", None)
        np.testing.assert_array_equal(split if split is not None else np.zeros(cli["cfg"].num_experts, bool), host[i])
    assert main(["generate", "--model", str(ckpt), "--plan", str(d / "j.plan"), "--prompt", "!#", "--max-new-tokens", "2"]) == 0
    assert main(argv[:-2] + ["--budget-kld", "1", "--target", "5", "--out", str(d / "k.plan")]) == 2
    assert "give one of --budget-kld X (least time within a loss) or --target TOK/S" in capsys.readouterr().err
    assert main(argv[:-2] + ["--budget-mb", "1", "--out", str(d / "k.plan")]) == 2
    assert "drop --budget-mb" in capsys.readouterr().err


def test_a_bundle_quantized_from_a_joint_plan_keeps_its_places(cli, tmp_path):  # noqa: F811
    """``moqe quantize --plan`` with a place column saves the places in the bundle's report: a device load takes
    them when given none, an explicit placement replaces them, a CPU load ignores them; a malformed entry is
    refused naming the report."""
    import json

    from toolkit.load import load_model

    cfg = cli["cfg"]
    host = np.zeros((cfg.num_layers, cfg.num_experts), bool)
    host[0, [0, 2]] = True
    (tmp_path / "p.plan").write_text(_placed_text(cfg, host))
    assert main(["quantize", "--model", str(cli["ckpt"]), "--plan", str(tmp_path / "p.plan"), "--out", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "uqff_report.json").read_text())
    assert report["placement"] == {"host": {"0": [0, 2]}}

    def split(m):
        return [None if getattr(l.ffn.experts, "host", None) is None else list(np.flatnonzero(l.ffn.experts.host)) for l in m.layers]

    m, _ = load_model(tmp_path / "b", "cuda-emu", activations="f32")
    assert split(m) == [[0, 2], None] and m.rt.places.label == "the bundle's placement"
    m, _ = load_model(tmp_path / "b", "cuda-emu", activations="f32", placement=PlacementSpec(n_cpu_moe=2))
    assert split(m) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    m, _ = load_model(tmp_path / "b", "numba")
    assert m.rt.places is None
    report["placement"] = {"host": {"0": [9]}}
    (tmp_path / "b" / "uqff_report.json").write_text(json.dumps(report))
    with pytest.raises(ToolkitError, match=r"uqff_report\.json: placement of layer 0: a list of expert ids in 0\.\.3"):
        load_model(tmp_path / "b", "cuda-emu")


def test_a_trace_of_another_model_is_refused_before_any_measuring(cli, tmp_path, capsys, monkeypatch):  # noqa: F811
    from toolkit.quant import sensitivity
    from toolkit.quant.trace import Trace, save

    monkeypatch.setattr(sensitivity, "calibrate", lambda *a, **k: pytest.fail("measured before checking the trace"))
    counts, pairs = np.zeros((2, 8), np.int64), np.zeros((2, 8, 8), np.int64)
    for j in range(2):  # 4 tokens routed among 8 experts: another model's trace
        add_tokens(counts[j], pairs[j], np.array([[0, 1], [2, 3], [4, 5], [6, 7]]))
    save(tmp_path / "other.trace", Trace((0, 1), counts, pairs, 4, 2))
    assert main(["plan", "--model", str(cli["ckpt"]), "--trace", str(tmp_path / "other.trace"), "--vram", "1", "--ram", "1",
                 "--out", str(tmp_path / "x.plan")]) == 2
    assert "other.trace: traced MoE layers [0, 1], 8 experts, top-2; the model has MoE layers [0, 1], 4 experts" in capsys.readouterr().err
