"""The bit-budget planner (``toolkit/quant/plan.py``), its plan files, calibrated scales
(``toolkit/quant/imatrix.py``), per-expert sensitivity (``toolkit/quant/sensitivity.py``) and ``moqe plan``.

Oracles: a brute-force search over every combination of choices (the knapsack's optimum, exact on instances
whose bytes need no rounding); round-to-nearest ``fmt.quantize`` (calibrated scales must not do worse on the
importance-weighted error, and must do markedly better in total: ``CALIBRATED_GAIN``); the plan file written by
``write_plan`` (read back exactly). Tolerances: solver losses to 1e-9 of brute force; weighted errors per row
within ``ROW_RTOL`` of round-to-nearest's (the f16 rounding of its own min/max candidate); everything else exact.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import random

import numpy as np
import pytest
import tiny_model
from test_uqff_support import tiny_checkpoint, tiny_qwen2_moe

from toolkit.cli import main
from toolkit.errors import FormatError, ModelError
from toolkit.formats import QTensor, get_format
from toolkit.load import load_model
from toolkit.model import Checkpoint, MoEModel, Tokenizer, load_config, load_weights
from toolkit.model.safetensors_io import save_file
from toolkit.quant import parse_policy, quantizing_transform
from toolkit.quant.imatrix import load_imatrix, quantize_weighted, save_imatrix
from toolkit.quant.plan import (
    Choice,
    items_from,
    parse_plan,
    plan_policy,
    policy_of,
    solve,
    solve_bits,
    uniform,
    write_plan,
)
from toolkit.quant.sensitivity import (
    ExpertStats,
    Sensitivity,
    calibration_ids,
    from_json,
    measure,
    record_layers,
    spread,
)
from toolkit.uqff import load_bundle


# ---- the solver ------------------------------------------------------------------------------------------
def C(fmt, nbytes, loss):
    return Choice(fmt, nbytes, loss)


# upgrading "a" saves the most (12 for 6 bytes); "b" and c's steps save more per byte (2.5, 2, then 0.5), so a
# greedy planner buying the best ratio first spends the spare bytes on them and cannot afford "a" (loss 12, not 8)
GREEDY_TRAP = {"a": [C("lo", 2, 12.0), C("hi", 8, 0.0)],
               "b": [C("lo", 2, 5.0), C("hi", 4, 0.0)],
               "c": [C("lo", 1, 3.0), C("mid", 2, 1.0), C("hi", 4, 0.0)]}
# (budget, the optimum's formats for a, b, c, its loss): worked out by hand (floor 5 bytes, ceiling 16)
KNOWN = [
    (5, ("lo", "lo", "lo"), 20.0),  # exactly the minimum
    (7, ("lo", "hi", "lo"), 15.0),
    (8, ("lo", "hi", "mid"), 13.0),
    (11, ("hi", "lo", "lo"), 8.0),  # greedy by ratio: b, c's mid step, c's hi step -> 12
    (13, ("hi", "hi", "lo"), 3.0),
    (16, ("hi", "hi", "hi"), 0.0),
    (1000, ("hi", "hi", "hi"), 0.0),
]


def brute_force(items: dict, budget: int) -> float:
    """The least summed loss of any combination within the budget (inf: none fits)."""
    keys = sorted(items)
    best = np.inf
    for combo in itertools.product(*(items[k] for k in keys)):
        if sum(c.nbytes for c in combo) <= budget:
            best = min(best, sum(c.loss for c in combo))
    return best


def greedy_by_ratio(items: dict, budget: int) -> float:
    """The planner's tempting shortcut: start cheapest, buy the upgrade with the best loss saved per byte."""
    pick = {k: min(v, key=lambda c: c.nbytes) for k, v in items.items()}
    spare = budget - sum(c.nbytes for c in pick.values())
    while True:
        ups = [((pick[k].loss - c.loss) / (c.nbytes - pick[k].nbytes), k, c) for k, v in items.items() for c in v
               if c.nbytes > pick[k].nbytes and c.loss < pick[k].loss and c.nbytes - pick[k].nbytes <= spare]
        if not ups:
            return sum(c.loss for c in pick.values())
        _, k, c = max(ups, key=lambda u: u[0])
        spare -= c.nbytes - pick[k].nbytes
        pick[k] = c


@pytest.mark.parametrize("budget,want,loss", KNOWN)
def test_solve_known_optimum(budget, want, loss):
    plan = solve(GREEDY_TRAP, budget)
    assert tuple(plan[k].fmt for k in "abc") == want
    assert sum(c.loss for c in plan.values()) == loss == brute_force(GREEDY_TRAP, budget)
    assert sum(c.nbytes for c in plan.values()) <= budget


def test_the_trap_catches_greedy():
    """The budget-11 row is one where buying the best ratio first is wrong (so the table can tell them apart)."""
    assert greedy_by_ratio(GREEDY_TRAP, 11) == 12.0 > sum(c.loss for c in solve(GREEDY_TRAP, 11).values()) == 8.0


# (items, budget, the smallest total the message must name)
TOO_SMALL = [
    (GREEDY_TRAP, 4, "5 bytes"),
    (GREEDY_TRAP, 0, "5 bytes"),
    ({"x": [C("int8", 1_234_567, 1.0), C("int4", 2_000_000, 0.5)]}, 1_234_566, r"1,234,567 bytes \(1\.235 MB\)"),
]


@pytest.mark.parametrize("items,budget,floor", TOO_SMALL)
def test_solve_refuses_a_budget_below_the_minimum_naming_it(items, budget, floor):
    with pytest.raises(FormatError, match=rf"a budget of {budget:,} bytes is too small: .* take {floor}"):
        solve(items, budget)


def test_solve_refuses_nothing_to_plan():
    with pytest.raises(FormatError, match="nothing to plan"):
        solve({}, 100)


def _random_items(rng: random.Random, scale: int = 1) -> dict:
    return {f"k{i}": [C(f"f{j}", scale * rng.randint(1, 40), round(rng.uniform(0, 10), 3)) for j in range(rng.randint(1, 4))]
            for i in range(rng.randint(1, 5))}


@pytest.mark.parametrize("seed", range(25))
def test_solve_matches_brute_force_and_never_exceeds_the_budget(seed):
    rng = random.Random(seed)
    items = _random_items(rng)
    floor = sum(min(c.nbytes for c in v) for v in items.values())
    top = sum(max(c.nbytes for c in v) for v in items.values())
    for budget in (floor, rng.randint(floor, top), top + 3):
        plan = solve(items, budget)
        assert set(plan) == set(items) and all(plan[k] in items[k] for k in items)
        assert sum(c.nbytes for c in plan.values()) <= budget
        assert sum(c.loss for c in plan.values()) == pytest.approx(brute_force(items, budget), abs=1e-9)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("max_units,scale", [(4, 1), (7, 1), (1 << 16, 100_003)])
def test_solve_with_rounded_units_stays_within_the_budget(seed, max_units, scale):
    """Bytes counted in units (each item's rounded up): never over budget, never better than the true optimum."""
    rng = random.Random(1000 + seed)
    items = _random_items(rng, scale)
    floor = sum(min(c.nbytes for c in v) for v in items.values())
    top = sum(max(c.nbytes for c in v) for v in items.values())
    for budget in (floor, rng.randint(floor, top), rng.randint(floor, top)):
        plan = solve(items, budget, max_units=max_units)
        assert sum(c.nbytes for c in plan.values()) <= budget
        assert sum(c.loss for c in plan.values()) >= brute_force(items, budget) - 1e-9


def _sensitivity(shapes: dict, losses: dict, formats=("int8", "int4-g32")) -> Sensitivity:
    s = Sensitivity("m", "text", 10, formats)
    for k, shape in shapes.items():
        s.shapes[k] = list(shape)
        s.loss[k] = dict(zip(formats, losses[k]))
        s.nbytes[k] = {f: get_format(f).nbytes(shape) for f in formats}
    return s


SHAPES = {(0, "gate_up", 0): (128, 64), (0, "down", 0): (64, 64), (1, "gate_up", 1): (128, 64)}
LOSSES = {(0, "gate_up", 0): (0.1, 2.0), (0, "down", 0): (0.1, 0.3), (1, "gate_up", 1): (0.2, 5.0)}


# (bits per weight, the plan's formats of down.0, gate_up.0, gate_up.1): by hand from int8 = 8704 / 4352 bytes
# (gate_up [128, 64] / down [64, 64]), int4-g32 = 5120 / 2560, 20480 weights
SOLVE_BITS = [
    (5.0, ("int4-g32", "int4-g32", "int4-g32")),  # 12800 bytes: int4-g32 everywhere, exactly
    (7.0, ("int4-g32", "int4-g32", "int8")),  # 17920: one gate_up at int8, the one saving most (4.8)
    (8.0, ("int4-g32", "int8", "int8")),  # 20480: both gate_ups (19968); down too would take 21760
    (8.5, ("int8", "int8", "int8")),  # 21760: int8 everywhere, exactly
]


@pytest.mark.parametrize("bits,want", SOLVE_BITS)
def test_solve_bits(bits, want):
    s = _sensitivity(SHAPES, LOSSES)
    plan = solve_bits(s, bits)
    assert tuple(plan[k].fmt for k in ("layers.0.moe.down.0", "layers.0.moe.gate_up.0", "layers.1.moe.gate_up.1")) == want


def test_items_from_and_uniform():
    s = _sensitivity(SHAPES, LOSSES)
    items = items_from(s)
    assert sorted(items) == ["layers.0.moe.down.0", "layers.0.moe.gate_up.0", "layers.1.moe.gate_up.1"]
    assert items["layers.0.moe.down.0"] == [C("int8", 4352, 0.1), C("int4-g32", 2560, 0.3)]
    assert uniform(items, "int4-g32") == (12800, pytest.approx(7.3))
    assert uniform(items, "int8") == (21760, pytest.approx(0.4))


# ---- plan files ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg(tmp_path_factory):  # 2 MoE layers, 4 experts, D = I = 64
    return load_config(tiny_model.write(tmp_path_factory.mktemp("plan") / "m"))


def full_plan(cfg, fmt="int4-g32") -> dict:
    return {f"layers.{i}.moe.{p}.{e}": fmt for i in range(cfg.num_layers) for p in ("gate_up", "down")
            for e in range(cfg.num_experts)}


def plan_text(plan: dict) -> list[str]:
    """One line per name, in write_plan's order (layer, projection, expert): line n is lines[n - 1]."""
    from toolkit.quant.plan import _order

    return [f"{n}={plan[n]}" for n in sorted(plan, key=_order)]


def test_write_plan_parse_plan_round_trip(cfg, tmp_path):
    plan = full_plan(cfg)
    plan |= {"layers.0.moe.down.3": C("int8", 1, 0.0), "layers.1.moe.gate_up.0": "q8_0", "layers.1.moe.down.2": "none",
             "layers.0.moe.gate_up.1": "int2-g64"}
    write_plan(tmp_path / "p.plan", plan, ["made by a test", "second line"], imatrix="p.imatrix")
    text = (tmp_path / "p.plan").read_text()
    assert text.splitlines()[:4] == ["# moqe plan", "# made by a test", "# second line", "#! imatrix=p.imatrix"]
    got = parse_plan(text, cfg)
    want = {n: (None if (c.fmt if isinstance(c, Choice) else c) == "none" else get_format(c.fmt if isinstance(c, Choice) else c))
            for n, c in plan.items()}
    assert got == want
    names = [ln.split("=")[0] for ln in text.splitlines() if not ln.startswith("#")]
    assert names[:5] == ["layers.0.moe.down.0", "layers.0.moe.down.1", "layers.0.moe.down.2", "layers.0.moe.down.3",
                         "layers.0.moe.gate_up.0"]


def test_parse_plan_takes_comments_blanks_and_spaces(cfg):
    lines = plan_text(full_plan(cfg))
    lines[0] = "  layers.0.moe.down.0 = int8   # the first expert is touchy"
    text = "# header\n\n" + "\n".join(lines) + "\n\n# end\n"
    got = parse_plan(text, cfg)
    assert got["layers.0.moe.down.0"].spec == "int8" and got["layers.0.moe.down.1"].spec == "int4-g32"


def _replace(name, line):
    return lambda lines: [line if ln.startswith(name + "=") else ln for ln in lines]


def _append(line):
    return lambda lines: lines + [line]


# (edit of the full int4-g32 plan, the line it names (0: none), message)
BAD_PLANS = [
    ("unknown-format", _replace("layers.0.moe.down.2", "layers.0.moe.down.2=int5"), 3, r"unknown format 'int5'"),
    ("unknown-expert", _append("layers.0.moe.down.4=int8"), 17, r"'layers\.0\.moe\.down\.4': the model has 4 experts per layer \(0\.\.3\)"),
    ("unknown-layer", _append("layers.2.moe.gate_up.0=int8"), 17, r"'layers\.2\.moe\.gate_up\.0': the model has no MoE layer 2 \(MoE layers: 0\.\.1\)"),
    ("attention-name", _append("layers.0.attn.q=int8"), 17, r"'layers\.0\.attn\.q' is not an expert projection"),
    ("whole-weight-name", _append("layers.0.moe.gate_up=int8"), 17, r"'layers\.0\.moe\.gate_up' is not an expert projection"),
    ("duplicate", _append("layers.1.moe.down.3=int8"), 17, r"'layers\.1\.moe\.down\.3' is already planned on line 12"),
    ("group-size", _replace("layers.0.moe.gate_up.1", "layers.0.moe.gate_up.1=int4-g128"), 6,
     r"tensor 'layers\.0\.moe\.gate_up\.1': inner dimension 64 .* group size 128"),
    ("no-equals", _replace("layers.1.moe.gate_up.0", "layers.1.moe.gate_up.0 int8"), 13, r"must look like layers\.I\.moe"),
    ("no-format", _replace("layers.1.moe.gate_up.0", "layers.1.moe.gate_up.0="), 13, r"must look like layers\.I\.moe"),
    ("missing", lambda lines: [ln for ln in lines if not ln.startswith("layers.1.moe.gate_up.2=")], 0,
     r"1 expert projection\(s\) have no line, e.g\. 'layers\.1\.moe\.gate_up\.2' \(a plan names all 16\)"),
]


@pytest.mark.parametrize("edit,line,message", [b[1:] for b in BAD_PLANS], ids=[b[0] for b in BAD_PLANS])
def test_parse_plan_refuses_naming_the_line(cfg, edit, line, message):
    text = "\n".join(edit(plan_text(full_plan(cfg))))
    where = rf"my\.plan, line {line}: " if line else r"my\.plan: "
    with pytest.raises(FormatError, match=where + ".*" + message):
        parse_plan(text, cfg, "my.plan")


def test_parse_plan_refuses_a_dense_layer(tmp_path):
    qcfg = load_config(tiny_qwen2_moe(tmp_path / "q"))  # layer 1 is a dense MLP
    plan = {f"layers.{i}.moe.{p}.{e}": "int8" for i in (0, 2) for p in ("gate_up", "down") for e in range(4)}
    parse_plan("\n".join(plan_text(plan)), qcfg)  # the MoE layers alone: complete
    with pytest.raises(FormatError, match=r"line 17: 'layers\.1\.moe\.down\.0': the model has no MoE layer 1"):
        parse_plan("\n".join(plan_text(plan) + ["layers.1.moe.down.0=int8"]), qcfg)


def test_plan_policy_reads_formats_and_its_importance_file(cfg, tmp_path):
    plan = full_plan(cfg) | {"layers.1.moe.down.2": "int8", "layers.0.moe.gate_up.3": "none"}
    imp = {(1, "down", 2): np.arange(64, dtype=np.float32), (0, "gate_up", 0): np.ones(64, np.float32)}
    save_imatrix(tmp_path / "p.imatrix.safetensors", imp)
    write_plan(tmp_path / "p.plan", plan, ["x"], imatrix="p.imatrix.safetensors")
    p = plan_policy(tmp_path / "p.plan", cfg)
    assert p.format_for("moe.down", "w", 1, expert=2).spec == "int8"
    assert p.format_for("moe.gate_up", "w", 0, expert=3) is None
    assert p.format_for("moe.gate_up", "w", 0, expert=2).spec == "int4-g32"
    assert p.format.spec == "int4-g32" and "plan=p.plan#" in p.label and "imatrix=p.imatrix.safetensors#" in p.label
    assert np.array_equal(p.importance("moe.down", 1, 2), imp[(1, "down", 2)])
    assert p.importance("moe.down", 1, 1) is None and p.importance("attn.q", 1, 2) is None


def test_plan_policy_refuses_a_missing_importance_file(cfg, tmp_path):
    write_plan(tmp_path / "p.plan", full_plan(cfg), [], imatrix="gone.safetensors")
    with pytest.raises(FormatError, match=r"p\.plan: names the importance file 'gone\.safetensors', which is not in"):
        plan_policy(tmp_path / "p.plan", cfg)


def test_plan_policy_names_the_file_of_a_bad_plan(cfg, tmp_path):
    (tmp_path / "bad.plan").write_text("\n".join(plan_text(full_plan(cfg))[:-1]))
    with pytest.raises(FormatError, match=r"bad\.plan: 1 expert projection"):
        plan_policy(tmp_path / "bad.plan", cfg)


def test_policy_of_keeps_importance_only_where_it_measured_better(cfg):
    plan = {n: C("int4-g32", 1, 0.0) for n in full_plan(cfg)} | {"layers.0.moe.down.1": C("int8", 1, 0.0)}
    s = Sensitivity("m", "t", 1, ("int8", "int4-g32"))
    for n in plan:
        _, i, _, proj, e = n.split(".")
        s.imatrix[(int(i), proj, int(e))] = np.full(64, 2.0, np.float32)
    s.calibrated = {(0, "down", 0): {"int4-g32"}, (0, "down", 1): {"int4-g32"}}  # expert 1 is planned at int8
    p = policy_of(plan, s)
    assert set(p.imatrix) == {(0, "down", 0)}
    assert p.format_for("moe.down", "w", 0, expert=1).spec == "int8" and p.format.spec == "int4-g32"
    assert policy_of(plan).imatrix is None


# ---- calibrated scales -----------------------------------------------------------------------------------
AFFINE = ["int2-g32", "int3-g64", "int4-g32", "int4-g128"]
OTHER = ["int8", "q8_0", "q4_0", "fp8", "f32"]  # no calibrated quantizer: round-to-nearest
ROW_RTOL = 1e-6  # the calibrated search includes round-to-nearest's own range; f32 midpoint arithmetic aside
CALIBRATED_GAIN = 0.9  # total weighted error <= 0.9 x round-to-nearest's (measured 0.44 .. 0.64)
IMPORTANCE = {
    "skewed": lambda rng, K: (rng.standard_normal(K) ** 2 * np.exp(rng.standard_normal(K))).astype(np.float32),
    "half-zero": lambda rng, K: np.where(np.arange(K) % 2 == 0, rng.random(K) + 0.5, 0).astype(np.float32),
}


def _w(seed=0, N=16, K=256):
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)


def _weighted_err(qt: QTensor, w, imp) -> np.ndarray:  # [N]
    return ((qt.dequantize("numpy").astype(np.float64) - w) ** 2 * imp).sum(axis=1)


@pytest.mark.parametrize("kind", list(IMPORTANCE))
@pytest.mark.parametrize("spec", AFFINE)
def test_quantize_weighted_same_layout_and_no_worse_than_round_to_nearest(spec, kind):
    fmt, w = get_format(spec), _w()
    imp = IMPORTANCE[kind](np.random.default_rng(1), w.shape[1])
    q, r = quantize_weighted(fmt, w, imp, "numba"), fmt.quantize(w, "numba")
    q.validate("calibrated")
    assert q.fmt == fmt and q.shape == r.shape and set(q.arrays) == set(r.arrays)
    for k in r.arrays:
        assert (q.arrays[k].dtype, q.arrays[k].shape) == (r.arrays[k].dtype, r.arrays[k].shape), k
    eq, er = _weighted_err(q, w, imp), _weighted_err(r, w, imp)
    assert np.all(eq <= er * (1 + ROW_RTOL)), f"rows worse than round-to-nearest: {np.nonzero(eq > er * (1 + ROW_RTOL))[0]}"
    assert eq.sum() <= CALIBRATED_GAIN * er.sum()


@pytest.mark.parametrize("spec", AFFINE + OTHER)
def test_quantize_weighted_without_importance_is_round_to_nearest(spec):
    fmt, w = get_format(spec), _w(2, 8, 128)
    imp = IMPORTANCE["skewed"](np.random.default_rng(3), 128)
    r = fmt.quantize(w, "numba")
    cases = [None] + ([imp] if spec in OTHER else [])  # formats without a calibrated quantizer ignore it
    for i in cases:
        q = quantize_weighted(fmt, w, i, "numba")
        assert set(q.arrays) == set(r.arrays)
        for k in r.arrays:
            assert np.array_equal(q.arrays[k].view(np.uint8), r.arrays[k].view(np.uint8)), (k, i is None)


BAD_IMPORTANCE = [
    ("short", lambda K: np.ones(K - 1, np.float32)),
    ("2-D", lambda K: np.ones((1, K), np.float32)),
    ("nan", lambda K: np.where(np.arange(K) == 5, np.nan, 1).astype(np.float32)),
    ("inf", lambda K: np.where(np.arange(K) == 5, np.inf, 1).astype(np.float32)),
    ("negative", lambda K: np.where(np.arange(K) == 5, -1, 1).astype(np.float32)),
]


@pytest.mark.parametrize("make", [b[1] for b in BAD_IMPORTANCE], ids=[b[0] for b in BAD_IMPORTANCE])
def test_quantize_weighted_refuses_bad_importance(make):
    with pytest.raises(FormatError, match=r"tensor 'w7': importance of shape \[.*\] does not fit its 256 input columns"):
        quantize_weighted(get_format("int4-g32"), _w(), make(256), name="w7")


def test_quantize_weighted_refuses_a_non_finite_weight():
    w = _w()
    w[3, 4] = np.nan
    with pytest.raises(FormatError, match="w7"):
        quantize_weighted(get_format("int4-g32"), w, np.ones(256, np.float32), name="w7")


def test_imatrix_file_round_trip(tmp_path):
    imp = {(0, "gate_up", 3): np.random.default_rng(0).random(64).astype(np.float32),
           (5, "down", 0): np.zeros(32, np.float32)}
    save_imatrix(tmp_path / "i.safetensors", imp, {"calibration": "text"})
    back = load_imatrix(tmp_path / "i.safetensors")
    assert set(back) == set(imp) and all(np.array_equal(back[k], imp[k]) and back[k].dtype == np.float32 for k in imp)


# (tensors of the file, message)
BAD_IMATRIX = [
    ({"layers.0.attn.q.1": np.ones(4, np.float32)}, r"tensor 'layers\.0\.attn\.q\.1' is not an importance vector"),
    ({"layers.0.moe.down.1": np.ones((2, 4), np.float32)}, r"tensor 'layers\.0\.moe\.down\.1' is not an importance vector"),
    ({"layers.0.moe.down.1": -np.ones(4, np.float32)}, r"tensor 'layers\.0\.moe\.down\.1' is not an importance vector"),
    ({}, "holds no importance vector"),
]


@pytest.mark.parametrize("tensors,message", BAD_IMATRIX)
def test_load_imatrix_refuses(tmp_path, tensors, message):
    save_file(tensors, tmp_path / "i.safetensors")
    with pytest.raises(FormatError, match=message):
        load_imatrix(tmp_path / "i.safetensors")


def test_policy_importance_reaches_the_quantizer(tmp_path):
    """Expert 1 of layer 0's down gets calibrated scales; every other expert projection round-to-nearest."""
    d = tiny_model.write(tmp_path / "m")
    c = load_config(d)
    imp = IMPORTANCE["skewed"](np.random.default_rng(4), 64)
    policy = dataclasses.replace(parse_policy("moqe", "int3-g32"), imatrix={(0, "down", 1): imp})
    q = load_weights(Checkpoint(d), c, transform=quantizing_transform(policy, "numba"))
    dense = load_weights(Checkpoint(d), c)
    fmt = get_format("int3-g32")
    for i in range(2):
        for proj in ("gate_up", "down"):
            got = q.layers[i].moe[proj]
            for e in range(4):
                w = dense.layers[i].moe[proj][e]
                calibrated = (i, proj, e) == (0, "down", 1)
                want = quantize_weighted(fmt, w, imp) if calibrated else fmt.quantize(w, "numba")
                for k in want.arrays:
                    assert np.array_equal(got.arrays[k][e], want.arrays[k]), (i, proj, e, k)
    rtn = fmt.quantize(dense.layers[0].moe["down"][1], "numba")
    assert not np.array_equal(q.layers[0].moe["down"].arrays["scales"][1], rtn.arrays["scales"])


# ---- sensitivity -----------------------------------------------------------------------------------------
SENS_FORMATS = ("int8", "int4-g32", "int3-g32", "int2-g32")  # more bits first
MIN_TOKENS = 16
DEAD = (0, 3)  # (layer, expert) the router never picks


def _never_route_expert_3(t):
    """A constant positive hidden coordinate 0 (in every embedding) and layer 0's router row 3 = -20 on it alone:
    expert 3's logit is far below the others' for every token."""
    t["model.embed_tokens.weight"][:, 0] = 5.0
    g = t["model.layers.0.block_sparse_moe.gate.weight"]
    g[3] = 0
    g[3, 0] = -20.0


@pytest.fixture(scope="module")
def sens(tmp_path_factory):
    """(round-to-nearest table, calibrated table, recorded layers) on 128 random tokens in windows of 32."""
    d = tiny_model.write(tmp_path_factory.mktemp("sens") / "m", mutate=_never_route_expert_3)
    c = load_config(d)
    w = load_weights(Checkpoint(d), c)
    model = MoEModel(c, w, "numpy")
    ids = np.random.default_rng(0).integers(3, 64, 128)
    rtn = measure(model, w, ids, window=32, formats=SENS_FORMATS, min_tokens=MIN_TOKENS, imatrix=False)
    cal = measure(model, w, ids, window=32, formats=SENS_FORMATS, min_tokens=MIN_TOKENS, imatrix=True)
    return rtn, cal, record_layers(model, ids, 32)


def test_record_layers_sees_every_window(sens):
    *_, seen = sens
    assert sorted(seen) == [0, 1]
    for i in (0, 1):
        assert [(x.shape, ids.shape, w.shape) for x, ids, w in seen[i]] == [((32, 64), (32, 2), (32, 2))] * 4
    assert not np.isin(DEAD[1], np.concatenate([r[1] for r in seen[DEAD[0]]]))


def test_every_expert_gets_stats_and_every_projection_a_loss(sens):
    rtn, _, _ = sens
    assert set(rtn.stats) == {(i, e) for i in (0, 1) for e in range(4)}
    assert rtn.items() == sorted((i, p, e) for i in (0, 1) for p in ("gate_up", "down") for e in range(4))
    for i in (0, 1):
        assert sum(s.tokens for (j, _), s in rtn.stats.items() if j == i) == 128 * 2  # T x top-k
    for k in rtn.items():
        assert set(rtn.loss[k]) == set(SENS_FORMATS) and all(v > 0 for v in rtn.loss[k].values()), k
        assert rtn.nbytes[k] == {f: get_format(f).nbytes(tuple(rtn.shapes[k])) for f in SENS_FORMATS}
    assert rtn.shapes[(0, "gate_up", 0)] == [128, 64] and rtn.shapes[(0, "down", 0)] == [64, 64]


def test_an_expert_never_routed_is_measured_on_forced_tokens(sens):
    rtn, _, _ = sens
    dead = rtn.stats[DEAD]
    assert (dead.tokens, dead.weight_sum, dead.forced) == (0, 0.0, MIN_TOKENS)
    for (i, e), s in rtn.stats.items():
        assert s.forced == (max(0, MIN_TOKENS - s.tokens)), (i, e)


@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_loss_falls_with_more_bits(sens, proj):
    """Round-to-nearest: int2 >= int3 >= int4 >= int8 on every expert (measured ratios <= 0.3)."""
    rtn, _, _ = sens
    for k in (k for k in rtn.items() if k[1] == proj):
        losses = [rtn.loss[k][f] for f in SENS_FORMATS]
        assert all(a <= b for a, b in itertools.pairwise(losses)), (k, losses)


def test_calibrated_losses_never_above_round_to_nearest(sens):
    rtn, cal, _ = sens
    affine = {f for f in SENS_FORMATS if get_format(f).kind == "affine"}
    for k in rtn.items():
        for f in SENS_FORMATS:
            assert cal.loss[k][f] <= rtn.loss[k][f], (k, f)
        assert cal.calibrated.get(k, set()) <= affine
        assert cal.imatrix[k].shape == (rtn.shapes[k][1],)
        assert cal.importance(k, "int8") is None
    assert sum(len(v) for v in cal.calibrated.values()) > 0 and not rtn.calibrated and not rtn.imatrix


def test_sensitivity_json_round_trip(sens):
    _, cal, _ = sens
    back = from_json(json.loads(json.dumps(cal.to_json())))
    assert (back.loss, back.nbytes, back.stats, back.shapes, back.calibrated, back.formats) == \
           (cal.loss, cal.nbytes, cal.stats, cal.shapes, cal.calibrated, cal.formats)
    assert isinstance(back.stats[DEAD], ExpertStats) and back.stats[DEAD].forced == MIN_TOKENS


def test_from_json_refuses_other_json():
    with pytest.raises(ModelError, match=r"s\.json: .*\(not a sensitivity table written by moqe plan\)"):
        from_json({"model": "m"}, "s.json")


SPREAD = [  # (n ids, n wanted, window, windows kept by their first id)
    (100, 200, 10, list(range(0, 100, 10))),  # fewer ids than wanted: all of them
    (100, 30, 10, [0, 40, 90]),
    (100, 10, 10, [0]),
]


@pytest.mark.parametrize("n,want,window,starts", SPREAD)
def test_spread_keeps_whole_windows(n, want, window, starts):
    got = list(spread(list(range(n)), want, window))
    assert got == [i for s in starts for i in range(s, min(s + window, n))]


# ---- moqe plan / quantize --plan / perplexity ------------------------------------------------------------
SAFE = "!#$%&()*+/0123456789:;<=>?@BDGJKLMNPQVZ[\\]"  # characters the bundled tokenizer keeps below id 64
CLI_FORMATS = "int8,int4-g32,int2-g64"  # int2-g64: the KLD probe's format (sensitivity.PROBE)


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, a text of ids < 64, and one `moqe plan` run (rc, paths)."""
    d = tmp_path_factory.mktemp("cli")
    ckpt = tiny_checkpoint(d / "m")
    text = "".join(random.Random(0).choice(SAFE) for _ in range(600))
    assert max(Tokenizer(ckpt, 1, [2]).encode(text)) < 64
    (d / "t.txt").write_text(text)
    base = ["--model", str(ckpt), "--calib-text", str(d / "t.txt"), "--calib-start", "0", "--calib-tokens", "256"]
    rc = main(["plan", *base, "--formats", CLI_FORMATS, "--budget-mb", "0.05", "--out", str(d / "p.plan"),
               "--sensitivity", str(d / "s.json")])
    return {"dir": d, "ckpt": ckpt, "base": base, "rc": rc, "cfg": load_config(ckpt)}


def _planned_bytes(plan: dict, cfg) -> int:
    return sum(f.nbytes((2 * cfg.expert_intermediate, cfg.hidden_size) if ".gate_up." in n else
                        (cfg.hidden_size, cfg.expert_intermediate)) for n, f in plan.items())


def test_cli_plan_writes_a_plan_within_budget(cli):
    d = cli["dir"]
    assert cli["rc"] == 0
    text = (d / "p.plan").read_text()
    plan = parse_plan(text, cli["cfg"])
    assert len(plan) == 16 and _planned_bytes(plan, cli["cfg"]) <= 50_000
    assert {f.spec for f in plan.values()} <= set(CLI_FORMATS.split(","))
    assert "#! imatrix=p.plan.imatrix.safetensors" in text.splitlines() and (d / "p.plan.imatrix.safetensors").is_file()
    table = json.loads((d / "s.json").read_text())
    assert len(from_json(table).items()) == 16 and (d / table["imatrix"]).is_file()


def test_cli_quantize_with_the_plan_then_perplexity(cli, capsys):
    d, ckpt = cli["dir"], cli["ckpt"]
    assert cli["rc"] == 0
    assert main(["quantize", "--model", str(ckpt), "--plan", str(d / "p.plan"), "--out", str(d / "b")]) == 0
    report = json.loads((d / "b" / "uqff_report.json").read_text())
    assert "plan=p.plan#" in report["policy"] and "imatrix=p.plan.imatrix.safetensors#" in report["policy"]
    policy = plan_policy(d / "p.plan", cli["cfg"])
    model, _ = load_bundle(d / "b")
    direct, _ = load_model(ckpt, policy=policy)
    ids = np.array([[1, 5, 9, 33, 7, 60, 2, 11]])
    np.testing.assert_array_equal(model.forward(ids, model.new_cache(1, 8)), direct.forward(ids, direct.new_cache(1, 8)))
    keys = {r["key"] for r in report["layers"]}
    for i in range(2):  # a weight whose experts the plan mixes is stored one expert at a time, others stacked
        base = f"model.layers.{i}.block_sparse_moe.experts"
        for proj, key in (("gate_up", "gate_proj"), ("down", "down_proj")):
            mixed = len({policy.format_for(f"moe.{proj}", "w", i, expert=e).spec for e in range(4)}) > 1
            assert (f"{base}.0.{key}" in keys, f"{base}.{key}" in keys) == (mixed, not mixed), (i, proj)
    capsys.readouterr()
    assert main(["perplexity", "--model", str(d / "b"), "--text", str(d / "t.txt"), "--max-tokens", "128"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_cli_plan_reuses_a_sensitivity_table(cli):
    d = cli["dir"]
    assert cli["rc"] == 0
    assert main(["plan", "--model", str(cli["ckpt"]), "--reuse", str(d / "s.json"), "--bits-per-weight", "3",
                 "--out", str(d / "r.plan")]) == 0
    plan = parse_plan((d / "r.plan").read_text(), cli["cfg"])
    params = 2 * 4 * 3 * cli["cfg"].hidden_size * cli["cfg"].expert_intermediate
    assert _planned_bytes(plan, cli["cfg"]) <= 3 * params / 8


def test_cli_plan_below_the_minimum_returns_2(cli, capsys):
    d = cli["dir"]
    rc = main(["plan", "--model", str(cli["ckpt"]), "--reuse", str(d / "s.json"), "--budget-mb", "0.001",
               "--out", str(d / "small.plan")])
    err = capsys.readouterr().err
    floor = _planned_bytes({n: get_format("int2-g64") for n in full_plan(cli["cfg"])}, cli["cfg"])
    assert rc == 2 and "a budget of 1,000 bytes is too small" in err and f"take {floor:,} bytes" in err
    assert err.count("\n") == 1 and not (d / "small.plan").exists()


@pytest.mark.parametrize("argv,message", [
    (["--budget-mb", "1", "--bits-per-weight", "4"], "give one of --budget-mb N or --bits-per-weight B"),
    ([], "give one of --budget-mb N or --bits-per-weight B"),
])
def test_cli_plan_refuses_bad_budget_flags(cli, capsys, argv, message):
    assert main(["plan", "--model", str(cli["ckpt"]), *argv, "--out", str(cli["dir"] / "x.plan")]) == 2
    assert message in capsys.readouterr().err


def test_cli_quantize_refuses_plan_with_experts(cli, capsys):
    rc = main(["quantize", "--model", str(cli["ckpt"]), "--plan", str(cli["dir"] / "p.plan"), "--experts", "int4"])
    assert rc == 2 and "drop --experts" in capsys.readouterr().err


def test_cli_plan_with_formats_leaving_out_the_probe(cli, capsys):
    """Candidate formats without sensitivity.PROBE (int2-g64): the per-layer KLD factors must still be measured
    (today: KeyError 'int2-g64' in layer_factors, rc 1)."""
    d = cli["dir"]
    rc = main(["plan", *cli["base"], "--formats", "int8,int4-g32,int2-g32", "--budget-mb", "0.05",
               "--out", str(d / "noprobe.plan")])
    assert rc == 0, capsys.readouterr().err
    assert len(parse_plan((d / "noprobe.plan").read_text(), cli["cfg"])) == 16


def test_calibration_ids_refuses_a_short_text(cli):
    tok = Tokenizer(cli["ckpt"], 1, [2])
    with pytest.raises(ModelError, match=r"t\.txt: \d+ tokens; calibration starts at token 8192"):
        calibration_ids(tok, cli["cfg"], (cli["dir"] / "t.txt").read_text(), "t.txt")
    assert len(calibration_ids(tok, cli["cfg"], (cli["dir"] / "t.txt").read_text(), "t.txt", 10, 50)) == 50


def test_bench_plan_rows(cli, capsys):
    """``python -m toolkit.bench plan`` on the tiny model: one full-precision row, the uniform rows (round-to-nearest
    and calibrated), and each planned budget within its bytes; KLD 0 only for full precision."""
    from toolkit.bench import plan as bench_plan

    d = cli["dir"]
    rows = bench_plan.run(["--model", str(cli["ckpt"]), "--text", str(d / "t.txt"), "--calib-start", "128",
                           "--calib-tokens", "256", "--max-tokens", "96", "--window", "32", "--stride", "16",
                           "--uniform", "int8,int2-g64", "--calibrated", "int2-g64", "--budgets", "int2-g64,0.9*int8"])
    kinds = [(r["kind"], r["configuration"]) for r in rows]
    assert kinds == [("none", "-"), ("uniform", "int8"), ("uniform", "int2-g64"), ("uniform+cal", "int2-g64"),
                     ("plan", "<= int2-g64"), ("plan", "<= 0.9*int8")]
    by = dict(zip(kinds, rows))
    assert by[("none", "-")]["KLD mean"] == 0 and all(r["KLD mean"] > 0 for r in rows[1:])
    assert by[("plan", "<= int2-g64")]["expert MB"] <= by[("uniform", "int2-g64")]["expert MB"] + 1e-12
    assert by[("plan", "<= 0.9*int8")]["expert MB"] <= 0.9 * by[("uniform", "int8")]["expert MB"] + 1e-12
    assert "planned expert mixes" in capsys.readouterr().out
