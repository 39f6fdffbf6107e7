"""The app's pieces without a server: configuration parsing, output-root confinement, the LRU model cache."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app.configs import InputError, context_limit, parse_config, parse_configs, parse_count  # noqa: E402
from app.models import ModelCache, view  # noqa: E402
from app.paths import bundle_under_root, under_root  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "data" / "model"

BAD_CONFIGS = [  # (format, policy, kv) -> words in the message
    (("int9", "moqe", "f32"), "expert format"),
    (("int4", "most", "f32"), "policy"),
    (("int4", "moqe", "q2_k"), "KV cache"),
]


@pytest.mark.parametrize("row,words", BAD_CONFIGS)
def test_bad_config_is_named(row, words):
    with pytest.raises(InputError, match=words):
        parse_config(*row)


@pytest.mark.parametrize("n", [1, 5, "x", None])
def test_config_count_bounds(n):
    with pytest.raises(InputError, match="2, 3 or 4"):
        parse_configs(n, [("none", "moqe", "f32")] * 4)


@pytest.mark.parametrize("value", [0, 201, 2.5, "many", None])
def test_count_bounds(value):
    with pytest.raises(InputError, match="max new tokens"):
        parse_count(value, "max new tokens", 1, 200)


def test_context_is_the_training_context():
    assert context_limit(MODEL) == 256


@pytest.mark.parametrize("name", ["../escape", "/etc", "a/../../b", "", "."])
def test_paths_outside_the_root_are_refused(tmp_path, name):
    with pytest.raises(InputError):
        under_root(tmp_path / "root", name)


def test_symlink_escape_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    assert under_root(root, "ok/b1") == (root / "ok" / "b1").resolve()
    with pytest.raises(InputError, match="outside"):
        under_root(root, "link/b1")
    with pytest.raises(InputError, match="no UQFF bundle"):
        bundle_under_root(root, "missing")


def test_cache_is_lru_bounded_and_shares_weights_across_kv_types():
    cache = ModelCache(capacity=2)
    a, hit = cache.get(MODEL, parse_config("none", "moqe", "f32"))
    assert not hit
    b, hit = cache.get(MODEL, parse_config("none", "moqe", "q4_0"))  # same weights, other KV type
    assert hit and b is a
    assert view(a, "q4_0").kv_types == ("q4_0", "q4_0") and a.model.kv_types == ("f32", "f32")
    cache.get(MODEL, parse_config("int8", "moqe", "f32"))
    cache.get(MODEL, parse_config("none", "moqe", "f32"))  # touch: int8 is now the oldest
    cache.get(MODEL, parse_config("int4", "moqe", "f32"))  # evicts int8
    labels = [k[1] for k in cache.keys()]
    assert labels == ["none", "moqe:int4-g64"] or labels == ["none", "moqe:int4"], labels
    assert cache.get(MODEL, parse_config("int4", "moqe", "f32"))[1]
    assert not cache.get(MODEL, parse_config("int8", "moqe", "f32"))[1]


class SlowWarmer:
    """A stand-in for ``toolkit.warmup.Warmer``: every step is 3 forward passes of 0.05 s, each inside the gate."""

    def __init__(self, backend, gate):
        self.gate, self.passes = gate, []  # (start, end) of each pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def step(self, st):
        import time

        for _ in range(3):
            with self.gate():
                t0 = time.monotonic()
                time.sleep(0.05)
                self.passes.append((t0, time.monotonic()))
        return f"{st[0]} {st[1]}", 0.15, 0


def test_a_request_during_warm_up_does_not_wait_for_it(tmp_path):
    """A Compare made while the warm-up runs says it may compile, then runs at once; the warm-up pauses for it
    (no forward pass of the warm-up starts while the request is served) and carries on after it."""
    import time

    from app import handlers as h
    from app.kernels import KernelWarmup
    from app.models import COMPUTE
    from app.ui import AppSettings

    runners = []
    settings = AppSettings(output_root=tmp_path)
    cache = ModelCache(2)
    cache.kernels = KernelWarmup(echo=None, lock=COMPUTE, runner=lambda b, gate: runners.append(SlowWarmer(b, gate))
                                 or runners[-1])
    assert cache.kernels.total > 30  # about 5 s of fake steps: far longer than the request
    cache.kernels.start()
    time.sleep(0.5)
    slots = ["none", "moqe", "f32", "int4", "moqe", "q8_0"] + ["none", "moqe", "f32"] * 2
    t0 = time.monotonic()
    outs = list(h.compare(settings, cache, str(MODEL), 2, *slots, "It is", 3, 0.0, 1))
    t1 = time.monotonic()
    assert outs[0][0].startswith("⏳ compiling") and outs[-1][0] and outs[-1][1]  # the note, then the texts
    assert not cache.kernels.ready.is_set(), "the request waited for the whole warm-up"
    passes = runners[0].passes
    assert not [p for p in passes if t0 + 0.15 < p[0] < t1], "the warm-up ran while the request was served"
    done = cache.kernels.done
    time.sleep(1.0)
    assert cache.kernels.done > done  # and it goes on once the request is done
    assert cache.kernels.wait(60) and cache.kernels.done == cache.kernels.total


def test_the_warm_up_starts_with_what_the_page_asks_first():
    from app.kernels import ordered_steps
    from app.ui import DEFAULT_SLOTS
    from toolkit.warmup import FAMILIES_ALL as FAMILIES
    from toolkit.warmup import KV_ALL, POLICIES, warm_steps

    steps = ordered_steps(DEFAULT_SLOTS)
    assert sorted(steps) == sorted(warm_steps(FAMILIES, KV_ALL, POLICIES, decode=True))  # each step once
    assert steps[:6] == [("core", "f32"), ("kv", "q8_0"), ("policy", "moqe:int4"), ("kv", "q4_0"),
                         ("policy", "moqe:int2"), ("policy", "all-linear:int3")]
    decode = [i for i, st in enumerate(steps) if st[0] == "decode"]
    assert decode == list(range(len(steps) - len(decode), len(steps)))  # the decode steps last,
    assert steps[decode[0]:decode[0] + 2] == [("decode", "moqe:int4:q8_0"), ("decode", "moqe:int2:q4_0")]  # defaults first


# ---- the Plan tab (app/plan.py), on a fake calibration of the bundled model ------------------------------
PLAN_FORMATS = ("int8", "int4-g64", "int2-g64")
FAKE_KLD = {"int8": 4e-6, "int4-g64": 4e-4, "int2-g64": 1e-2}  # predicted mean KLD of each format everywhere


def fake_sensitivity(model=MODEL, formats=PLAN_FORMATS, seed=0):
    """A Sensitivity of ``model``'s expert projections with made-up losses (some experts matter 10x more)."""
    import numpy as np

    from toolkit.formats import get_format
    from toolkit.model import load_config
    from toolkit.quant.sensitivity import ExpertStats, Sensitivity

    cfg = load_config(model)
    rng = np.random.default_rng(seed)
    sens = Sensitivity(str(model), "fake calibration", 256, tuple(formats))
    layers = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    n = 2 * len(layers) * cfg.num_experts
    for i in layers:
        for e in range(cfg.num_experts):
            sens.stats[(i, e)] = ExpertStats(64, 10.0)
            for p, shape in (("gate_up", [2 * cfg.expert_intermediate, cfg.hidden_size]),
                             ("down", [cfg.hidden_size, cfg.expert_intermediate])):
                w = float(rng.choice([0.2, 2.0]))
                sens.shapes[(i, p, e)] = shape
                sens.loss[(i, p, e)] = {f: w * FAKE_KLD[f] / n for f in formats}
                sens.nbytes[(i, p, e)] = {f: int(get_format(f).nbytes(shape)) for f in formats}
    return sens


class Bar:
    def __init__(self):
        self.calls = []

    def __call__(self, value, desc=None, unit=None):
        self.calls.append((value, desc))


@pytest.fixture
def planning(monkeypatch, tmp_path):
    """(settings, cache, planner, calls): ``calibrate`` replaced by the fake (its calls recorded)."""
    from app import plan
    from app.ui import AppSettings

    calls = []

    def fake(model_dir, text_path, start, tokens, formats, backend, progress):
        calls.append((model_dir, start, tokens, formats))
        for _ in range(32):
            progress.update(1)
        return fake_sensitivity(model_dir, formats)

    monkeypatch.setattr(plan, "calibrate", fake)
    settings = AppSettings(output_root=tmp_path / "out", calib_formats=PLAN_FORMATS, plan_points=2)
    return settings, ModelCache(2), plan.Planner(), calls


def test_plan_calibrates_once_then_plans_any_budget(planning):
    from app import plan

    settings, cache, planner, calls = planning
    src = str(MODEL.resolve())
    bar = Bar()
    assert "Calibrated: 64 expert projections at 3 formats" in plan.plan_calibrate(settings, cache, planner, src, bar)
    assert bar.calls[-1][0] == (32, 32) and "calibrating" in bar.calls[-1][1]
    totals = []
    for unit, bits, mb in [("bits/weight", 4.0, None), ("bits/weight", 2.5, None), ("MB", None, 9.0)]:
        status, table, pts, chart = plan.plan(settings, cache, planner, src, unit, bits, mb, 1024)
        total = table.iloc[-1]
        assert total["format"] == "total" and total["expert projections"] == 64
        assert total["bits/weight"] <= (bits or 8 * 9e6 / 2**22 / 2) + 1e-9 and f"{total['bits/weight']:.3f}" in status
        assert table["gate_up"].iloc[:-1].sum() == table["down"].iloc[:-1].sum() == 32
        totals.append(total)
        # the chart: the three uniform formats, two planned mixes and this plan, all predicted (nothing measured yet)
        assert sorted(chart["series"].unique()) == ["planned (predicted)", "this plan (predicted)", "uniform (predicted)"]
        assert len(pts) == 3 + 2 + 1 and set(pts["measured KLD"]) == {"-"}
    assert len(calls) == 1  # the budgets were planned from the one calibration
    assert totals[1]["predicted KLD"] > totals[0]["predicted KLD"]  # less room, more loss
    assert abs(totals[2]["MB"] - 9.0) < 0.2


def test_plan_beats_the_uniform_format_of_its_size(planning):
    from app import plan

    settings, cache, planner, _ = planning
    _, table, pts, _ = plan.plan(settings, cache, planner, str(MODEL), "bits/weight", 4.6, None, 1024)
    uni = pts[pts["configuration"] == "uniform int4-g64"].iloc[0]  # 4.5 bits/weight
    assert table.iloc[-1]["predicted KLD"] < uni["predicted KLD"] and table.iloc[-1]["MB"] <= uni["expert MB"] * 1.03


BAD_BUDGETS = [  # (unit, bits, mb) -> words
    (("bits/weight", 1.0, None), r"too small.*smallest formats.*\(2\.50 bits/weight\)"),
    (("MB", None, 0.5), "too small"),
    (("MB", None, -3), "positive"),
    (("bits/weight", float("nan"), None), "positive"),
    (("bits/weight", "x", None), "must be a number"),
    (("parsecs", 4, None), "budget unit"),
]


@pytest.mark.parametrize("budget,words", BAD_BUDGETS)
def test_bad_budget_is_a_message(planning, budget, words):
    import gradio as gr

    from app import handlers as h
    from app import plan

    settings, cache, planner, _ = planning
    with pytest.raises(InputError, match=words):
        plan.plan(settings, cache, planner, str(MODEL), *budget, 1024)
    with pytest.raises(gr.Error, match=words.split(".")[0]):  # as the page shows it: a message, no traceback
        h.friendly(plan.plan)(settings, cache, planner, str(MODEL), *budget, 1024)


def test_plan_refuses_a_bundle_source(planning, monkeypatch):
    from app import handlers as h
    from app import plan

    settings, cache, planner, calls = planning
    monkeypatch.setattr(h, "is_bundle", lambda path: True)  # as if a bundle were loaded (Load bundle)
    with pytest.raises(InputError, match="is a UQFF bundle; switch to the base model to plan"):
        plan.plan(settings, cache, planner, str(MODEL), "bits/weight", 4, None, 1024)
    assert not calls


def test_plan_save_writes_bundle_and_plan_file_and_lists_it(planning):
    from app import handlers as h
    from app import plan
    from toolkit.model import load_config
    from toolkit.quant.plan import plan_policy
    from toolkit.uqff import is_bundle

    settings, cache, planner, _ = planning
    src = str(MODEL.resolve())
    msg, pick = plan.plan_save(settings, cache, planner, src, "bits/weight", 3.5, None, "plans/p35")
    out = (settings.output_root / "plans" / "p35").resolve()
    assert is_bundle(out) and "Saved **plans/p35**" in msg and "p35.plan" in msg
    assert pick["value"] == "plans/p35"
    _, table, _, _ = plan.plan(settings, cache, planner, src, "bits/weight", 3.5, None, 1024)
    policy = plan_policy(out.parent / "p35.plan", load_config(MODEL))  # the plan file beside it reads back
    counts = {}
    for _, f in policy.plan:
        counts[f.spec] = counts.get(f.spec, 0) + 1
    assert counts == {r["format"]: r["expert projections"] for _, r in table.iloc[:-1].iterrows()}
    # selectable in Compare: Load bundle runs it as written
    _, status = h.load_bundle(settings, cache, "plans/p35")
    assert "p35" in status and "plan=p35.plan#" in status
    loaded, _ = cache.get(out, parse_config("none", "moqe", "f32"))
    experts = [r for r in loaded.report.rows if r["role"].startswith("moe.") and r["role"] != "moe.router"]
    stored = 8 * sum(r["bytes"] for r in experts) / sum(math.prod(r["shape"]) for r in experts)
    assert stored == pytest.approx(table.iloc[-1]["bits/weight"], abs=1e-3)  # the bundle holds the plan
    # saved again (same name): the bundle and its plan file are replaced; anything else is refused
    assert "Saved" in plan.plan_save(settings, cache, planner, src, "bits/weight", 5, None, "plans/p35")[0]
    (settings.output_root / "mine.plan").write_text("my notes\n")
    for name, words in [("mine", "not a plan file"), ("../escape", "outside the output root"), ("", "give a bundle")]:
        with pytest.raises(InputError, match=words):
            plan.plan_save(settings, cache, planner, src, "bits/weight", 4, None, name)
    assert (settings.output_root / "mine.plan").read_text() == "my notes\n" and not (settings.output_root / "mine").exists()


def test_plan_measure_adds_measured_points(planning):
    from app import plan

    settings, cache, planner, _ = planning
    src = str(MODEL.resolve())
    bar = Bar()
    status, table, pts, chart = plan.plan_measure(settings, cache, planner, src, "bits/weight", 4.0, None, 128, bar)
    assert "measured" in status and "measured" in " ".join(chart["series"])
    kld = dict(zip(pts["configuration"], pts["measured KLD"]))
    assert 0 < kld["uniform int8"] < kld["uniform int4-g64"] < kld["uniform int2-g64"]
    assert all(isinstance(v, float) and v > 0 for v in kld.values())
    assert bar.calls and "KLD of" in bar.calls[-1][1]
    assert set(chart["series"]) >= {"uniform (measured)", "planned (measured)", "this plan (measured)"}
    # cached: measuring again is instant, and a plain Plan at the same token count shows them
    assert "already measured" in plan.plan_measure(settings, cache, planner, src, "bits/weight", 4.0, None, 128)[0]
    assert "uniform (measured)" in set(plan.plan(settings, cache, planner, src, "bits/weight", 4.0, None, 128)[3]["series"])
    with pytest.raises(InputError, match="held-out tokens"):
        plan.plan_measure(settings, cache, planner, src, "bits/weight", 4.0, None, settings.calib_start + 1)


def test_the_quality_plot_shows_every_point_and_names_the_reference():
    import pandas as pd

    from app.handlers import padded, quality_plot

    table = pd.DataFrame({"configuration": ["f32 (none) / KV f32", "moqe:int4 / KV q8_0", "moqe:int2 / KV q4_0"],
                          "bits/weight": [32.0, 6.1, 3.9], "perplexity": [69.8, 71.2, 140.5]})
    plot = quality_plot(table)
    for col, lim in (("bits/weight", plot.x_lim), ("perplexity", plot.y_lim)):
        lo, hi = lim
        span = table[col].max() - table[col].min()
        assert lo < table[col].min() - 0.05 * span and hi > table[col].max() + 0.05 * span  # margins on both sides
        assert lo > table[col].min() - 0.5 * span  # scaled to the data, not from zero
    assert [r for r in plot.value["data"] if "(reference)" in str(r)], plot.value
    assert padded([5.0]) == [4.5, 5.5]


# ---- the Plan tab's Placement view (app/placement.py) -------------------------------------------------------------
def test_placement_view_plans_a_grid_and_measures_it_on_the_emulated_device(planning, monkeypatch):
    """On the fake calibration: budgets that force a split give a grid of every MoE layer x expert (each cell a
    format pair and a place mark) within both budgets, the routing heat map of the held-out tokens, the plan against
    the uniform rules; *Load and measure* loads it on cuda-emu and reports the measured bytes per side and bus bytes;
    a budget below the rest of the model is refused naming it."""
    import re

    from app import placement
    from app.configs import InputError
    from toolkit.quant import joint

    monkeypatch.setattr(joint, "measure_host_gbs", lambda formats, *a, **k: {f: 5.0 for f in formats})
    monkeypatch.setattr(placement, "measure_host_gbs", lambda formats, *a, **k: {f: 5.0 for f in formats})
    from toolkit.model import load_config
    from toolkit.model.inspect import parameter_count

    settings, cache, planner, _ = planning
    src = str(MODEL)
    c = parameter_count(load_config(MODEL))
    rest = 4 * (c["attention"] + c["other"])  # the device's f32 bytes before any expert
    int4 = sum(v["int4-g64"] for v in fake_sensitivity().nbytes.values())  # every expert at int4-g64
    vram_mb, ram_mb = (rest + 0.5 * int4) / 1e6, 0.6 * int4 / 1e6  # room for about 60 % int4 on one side, 50 % other
    args = (settings, cache, planner, src, vram_mb, ram_mb, "least loss", 0, 256)
    status, grid, heat, rules = placement.place(*args)
    df = grid.data
    assert df.shape == (4, 8) and all(re.fullmatch(r"[\w-]+/[\w-]+ [DH]", v) for v in df.values.ravel())
    on_host = sum(v.endswith("H") for v in df.values.ravel())
    assert 0 < on_host < 32 and "Joint plan: expected" in status
    assert heat.data.shape == (4, 8) and abs(heat.data.values.sum(axis=1) - 100).max() < 0.5  # shares per layer
    assert rules["plan"].iloc[0] == "joint (this grid)" and rules["host MB"].iloc[0] <= ram_mb
    measured = placement.place_measure(*args)
    m = re.search(r"routed experts \*\*([\d.]+) MB on the device, ([\d.]+) MB on the host\*\*", measured)
    assert m and float(m.group(2)) > 0 and "bus per decode step: in" in measured
    with pytest.raises(InputError, match=r"the rest of the model .* needs [\d.]+ GB of the device"):
        placement.place(settings, cache, planner, src, rest / 2e6, ram_mb, "least loss", 0, 256)
