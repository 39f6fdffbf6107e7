"""The Blocks page: shared configuration rows above four tabs (Compare, Measure, Quantize & save, Plan)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from toolkit.formats import FORMATS as REGISTRY  # noqa: E402
from toolkit.quant.sensitivity import CALIBRATION_START, CALIBRATION_TOKENS, CANDIDATES  # noqa: E402
from toolkit.warmup import Warmer  # noqa: E402

from . import handlers as h  # noqa: E402
from . import placement as placing  # noqa: E402
from . import plan as planning  # noqa: E402
from .configs import FORMATS, KV_TYPES, MAX_NEW_TOKENS, POLICIES, context_limit  # noqa: E402
from .kernels import KernelWarmup  # noqa: E402
from .models import COMPUTE, ModelCache  # noqa: E402
from .serving import App  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SLOTS = [("none", "moqe", "f32"), ("int4", "moqe", "q8_0"), ("int2", "moqe", "q4_0"), ("int3", "all-linear", "q8_0")]
# every format a bundle can store, with each group size a format takes
SAVE_FORMATS = [s for f in REGISTRY.values() if f.uqff_tag is not None
                for s in [f.name, *(f"{f.name}-g{g}" for g in f.group_sizes)]]
PROMPT = "It is a truth universally acknowledged"


@dataclass
class AppSettings:
    model: Path = ROOT / "data" / "model"
    output_root: Path = Path("out")
    heldout: Path = ROOT / "data" / "heldout.txt"
    cache_size: int = 4
    backend: str = "numba"
    activations: str | None = None  # the quantized experts' GEMM activations on numba (None: int8; 'f32': exact)
    context: int | None = None  # None: the checkpoint's training context (else max_position_embeddings)
    ppl_tokens: int = 1024  # default held-out tokens for Measure
    calib_start: int = CALIBRATION_START  # the planner calibrates on the held-out tokens from here on
    calib_tokens: int = CALIBRATION_TOKENS  # how many (0: all)
    calib_formats: tuple = CANDIDATES  # the formats the planner chooses from
    plan_points: int = 9  # planned mixes on the Plan tab's chart, cheapest to largest

    def __post_init__(self):
        self.model, self.output_root, self.heldout = Path(self.model), Path(self.output_root), Path(self.heldout)
        self.context = self.context or context_limit(self.model)


def _shown(path: Path) -> str:
    p = path.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def build_app(settings: AppSettings | None = None, warm: bool = True) -> App:
    """The page. ``warm``: compile every kernel the page can use in the background (``app/kernels.py``),
    starting once ``launch`` has the server up (``app/serving.py``: a compiling thread started earlier can
    make Gradio's start-up self-check time out on a busy machine); requests that arrive before it is done
    wait for it and say so."""
    s = settings or AppSettings()
    s.output_root.mkdir(parents=True, exist_ok=True)
    cache = ModelCache(s.cache_size, s.backend, s.activations)
    cache.kernels = KernelWarmup(s.backend, lock=COMPUTE, defaults=DEFAULT_SLOTS,  # the page's rows first
                                 runner=functools.partial(Warmer, activations=s.activations))
    planner = planning.Planner()
    if not warm:
        cache.kernels.ready.set()
    base = str(s.model.resolve())

    with App(title="MoQE Toolkit: compare bit widths") as demo:
        demo.on_served = cache.kernels.start if warm else None
        demo.model_cache, demo.planner = cache, planner  # for tests and introspection
        gr.Markdown(f"# MoQE Toolkit: compare expert bit widths\nModel **{_shown(s.model)}** · context **{s.context}** "
                    f"tokens · up to {s.cache_size} models cached")
        kernel_md = gr.Markdown(cache.kernels.status_line(), elem_id="kernel-status")
        ticker = gr.Timer(1.0, active=not cache.kernels.ready.is_set())
        source = gr.State(base)
        status = gr.Markdown(f"Using the base model **{_shown(s.model)}**.", elem_id="model-status")
        with gr.Group():
            n = gr.Radio([2, 3, 4], value=2, label="Configurations", elem_id="n-configs")
            slots, rows = [], []
            for i, (f, p, k) in enumerate(DEFAULT_SLOTS):
                with gr.Row(visible=i < 2) as row:
                    slots += [gr.Dropdown(list(FORMATS), value=f, label=f"#{i + 1} expert format", allow_custom_value=True),
                              gr.Dropdown(list(POLICIES), value=p, label=f"#{i + 1} policy"),
                              gr.Dropdown(list(KV_TYPES), value=k, label=f"#{i + 1} KV cache")]
                rows.append(row)

        with gr.Tabs():
            with gr.Tab("Compare"):
                prompt = gr.Textbox(PROMPT, label="Prompt", lines=2, elem_id="prompt")
                with gr.Row():
                    max_new = gr.Number(48, label=f"Max new tokens (1..{min(MAX_NEW_TOKENS, s.context - 1)})", precision=0,
                                        elem_id="max-new")
                    temperature = gr.Number(0.7, label="Temperature (0 = greedy)")
                    seed = gr.Number(1234, label="Seed (same for every configuration)", precision=0)
                go = gr.Button("Compare", variant="primary", elem_id="compare-btn")
                outs, mds, cols = [], [], []
                with gr.Row():
                    for i in range(4):
                        with gr.Column(visible=i < 2, min_width=200) as col:
                            outs.append(gr.Textbox(label=f"Output #{i + 1}", lines=5, elem_id=f"out-{i + 1}"))
                            mds.append(gr.Markdown(elem_id=f"metrics-{i + 1}"))
                        cols.append(col)
                table = gr.Dataframe(label="Metrics", elem_id="metrics-table", interactive=False)

            with gr.Tab("Measure"):
                gr.Markdown(f"Held-out perplexity of the configurations above on `{s.heldout.name}` "
                            f"(disjoint windows of {s.context} tokens). Weight MB is what the process holds: the "
                            f"embeddings and LM head stay in the checkpoint's 16-bit type (the tables of docs/quantization.md count "
                            f"full-precision weights at 4 bytes).")
                n_tok = gr.Number(s.ppl_tokens, label="Held-out tokens", precision=0)
                run = gr.Button("Measure", variant="primary")
                ppl = gr.Dataframe(label="Perplexity", interactive=False)
                with gr.Row():
                    scatter = gr.ScatterPlot(x="bits/weight", y="perplexity", color="configuration",
                                             title="Perplexity vs bits per weight")
                    bars = gr.BarPlot(x="configuration", y="MB", color="part", title="Memory per configuration")

            with gr.Tab("Quantize & save"):
                gr.Markdown(f"Bundles are written and loaded only under the output root `{s.output_root.resolve()}`.")
                with gr.Row():
                    q_pre = gr.Dropdown(list(POLICIES), value="moqe", label="Policy")
                    q_fmt = gr.Dropdown(SAVE_FORMATS, value="int4", label="Format", allow_custom_value=True)
                    q_name = gr.Textbox("moqe-int4", label="Bundle directory (under the output root)")
                save = gr.Button("Quantize & save", variant="primary")
                save_md = gr.Markdown()
                with gr.Row():
                    pick = gr.Dropdown(h.list_bundles(s.output_root), label="Bundle under the output root",
                                       allow_custom_value=True)
                    refresh = gr.Button("Refresh")
                    load = gr.Button("Load bundle")
                    use_base = gr.Button("Use base model")

            with gr.Tab("Plan"):
                gr.Markdown(f"One format per routed expert projection under a budget, chosen from "
                            f"{', '.join(s.calib_formats)} by each expert's sensitivity, calibrated on `{s.heldout.name}` "
                            f"tokens from {s.calib_start} on (once per model: minutes; then every budget plans at once). "
                            f"KLD is the mean KL divergence from the full-precision model: predicted by the calibration, "
                            f"or measured on the first held-out tokens (as in Measure).")
                with gr.Row():
                    p_unit = gr.Radio(list(planning.UNITS), value=planning.UNITS[0], label="Budget in")
                    p_bits = gr.Slider(*planning.BITS_RANGE, value=4.0, step=0.05, label="Bits per routed expert weight")
                    p_mb = gr.Number(5.0, label="Routed experts, MB")
                with gr.Row():
                    p_cal = gr.Button("Calibrate", elem_id="plan-calibrate")
                    p_go = gr.Button("Plan", variant="primary", elem_id="plan-btn")
                    p_tok = gr.Number(s.ppl_tokens, label="Held-out tokens to measure", precision=0, elem_id="plan-tokens")
                    p_meas = gr.Button("Measure", elem_id="plan-measure")
                p_md = gr.Markdown(elem_id="plan-status")
                with gr.Row():
                    p_table = gr.Dataframe(label="The plan: expert projections per format", interactive=False)
                    p_chart = gr.ScatterPlot(x="expert MB", y="log10 KLD", color="series", tooltip="all",
                                             color_map=planning.SERIES_COLORS,
                                             title="Routed expert bytes against KLD (log10)")
                p_points = gr.Dataframe(label="Uniform formats and planned mixes", interactive=False)
                with gr.Row():
                    p_name = gr.Textbox("plan-4bpw", label="Bundle directory (under the output root)")
                    p_save = gr.Button("Save as bundle", variant="primary", elem_id="plan-save")
                    p_use = gr.Button("Load it for Compare")
                p_save_md = gr.Markdown()
                with gr.Accordion("Placement: a format and a place (device or host) for every expert", open=False):
                    gr.Markdown("Routed experts on a device (GPU) or the host (CPU), planned with their formats under "
                                "both budgets, from the calibration above and the routing of the held-out tokens "
                                "(`moqe plan --vram --ram --trace`; docs/placement.md). Device MB counts the whole "
                                "model; attention and the rest take theirs first.")
                    with gr.Row():
                        x_vram = gr.Number(25.0, label="Device MB")
                        x_ram = gr.Number(2.0, label="Host MB for experts")
                        x_goal = gr.Radio(list(placing.GOALS), value=placing.GOALS[0], label="Goal")
                        x_value = gr.Number(0.01, label="KLD budget or tok/s target")
                    with gr.Row():
                        x_go = gr.Button("Plan places", variant="primary", elem_id="place-btn")
                        x_meas = gr.Button("Load and measure (emulated device)", elem_id="place-measure")
                    x_md = gr.Markdown(elem_id="place-status")
                    x_grid = gr.Dataframe(label="The plan: layers x experts (gate/up / down format; D device, H host)",
                                          interactive=False)
                    with gr.Row():
                        x_heat = gr.Dataframe(label="Routing: each expert's share of its layer's slots", interactive=False)
                        x_rules = gr.Dataframe(label="Expected time per token: the plan and --n-cpu-moe N", interactive=False)
                    x_meas_md = gr.Markdown(elem_id="place-measured")

        def show(k):
            k = int(k)
            return [gr.update(visible=i < k) for i in range(4)] * 2

        n.change(show, n, rows + cols, api_name=False, queue=False)

        def do_compare(src, k, *rest):
            yield from h.friendly(h.compare)(s, cache, src, k, *rest)

        def served(fn, *a, **k):  # every request pauses the kernel warm-up while it is served (app/kernels.py)
            with h.serving(cache):
                return h.friendly(fn)(*a, **k)

        def do_measure(src, k, *rest, progress=gr.Progress(track_tqdm=True)):
            return served(h.measure, s, cache, src, k, *rest, progress=progress)

        def do_save(src, pre, fmt, name, progress=gr.Progress(track_tqdm=True)):
            return served(h.quantize_save, s, cache, src, pre, fmt, name, progress=progress)

        def do_load(name):
            return served(h.load_bundle, s, cache, name)

        def do_calibrate(src, progress=gr.Progress()):
            return served(planning.plan_calibrate, s, cache, planner, src, progress=progress)

        def do_plan(src, unit, bits, mb, n_tok, progress=gr.Progress()):
            return served(planning.plan, s, cache, planner, src, unit, bits, mb, n_tok, progress=progress)

        def do_plan_measure(src, unit, bits, mb, n_tok, progress=gr.Progress()):
            return served(planning.plan_measure, s, cache, planner, src, unit, bits, mb, n_tok, progress=progress)

        def do_plan_save(src, unit, bits, mb, name, progress=gr.Progress()):
            return served(planning.plan_save, s, cache, planner, src, unit, bits, mb, name, progress=progress)

        def do_place(src, vram, ram, goal, value, n_tok, progress=gr.Progress()):
            return served(placing.place, s, cache, planner, src, vram, ram, goal, value, n_tok, progress=progress)

        def do_place_measure(src, vram, ram, goal, value, n_tok, progress=gr.Progress()):
            return served(placing.place_measure, s, cache, planner, src, vram, ram, goal, value, n_tok, progress=progress)

        def cleared(k):  # a new run first empties the results it replaces: an error never sits under old ones
            return lambda: [None] * k

        go.click(cleared(9), None, [*outs, *mds, table], queue=False, api_name=False).then(
            do_compare, [source, n, *slots, prompt, max_new, temperature, seed], [*outs, *mds, table],
            api_name="compare", concurrency_limit=4)
        run.click(cleared(3), None, [ppl, scatter, bars], queue=False, api_name=False).then(
            do_measure, [source, n, *slots, n_tok], [ppl, scatter, bars], api_name="measure")
        save.click(cleared(1), None, [save_md], queue=False, api_name=False).then(
            do_save, [source, q_pre, q_fmt, q_name], [save_md, pick], api_name="quantize_save")
        load.click(do_load, [pick], [source, status], api_name="load_bundle")
        use_base.click(lambda: h.use_base(s), None, [source, status], api_name="use_base_model")
        budget = [source, p_unit, p_bits, p_mb]
        p_cal.click(do_calibrate, [source], p_md, api_name="plan_calibrate")
        plan_out = [p_md, p_table, p_points, p_chart]
        p_go.click(cleared(4), None, plan_out, queue=False, api_name=False).then(
            do_plan, [*budget, p_tok], plan_out, api_name="plan")
        p_meas.click(cleared(4), None, plan_out, queue=False, api_name=False).then(
            do_plan_measure, [*budget, p_tok], plan_out, api_name="plan_measure")
        p_save.click(cleared(1), None, [p_save_md], queue=False, api_name=False).then(
            do_plan_save, [*budget, p_name], [p_save_md, pick], api_name="plan_save")
        p_use.click(do_load, [pick], [source, status], api_name=False)
        place_in, place_out = [source, x_vram, x_ram, x_goal, x_value, p_tok], [x_md, x_grid, x_heat, x_rules]
        x_go.click(cleared(4), None, place_out, queue=False, api_name=False).then(
            do_place, place_in, place_out, api_name="place")
        x_meas.click(cleared(1), None, [x_meas_md], queue=False, api_name=False).then(
            do_place_measure, place_in, [x_meas_md], api_name="place_measure")
        refresh.click(lambda: h.refresh_bundles(s), None, pick, api_name=False)

        def tick():
            return cache.kernels.status_line(), gr.Timer(active=not cache.kernels.ready.is_set())

        ticker.tick(tick, None, [kernel_md, ticker], api_name=False, queue=False)
        demo.load(tick, None, [kernel_md, ticker], api_name=False, queue=False)
        status_api = gr.JSON(visible=False)
        gr.Button(visible=False).click(lambda: cache.kernels.status(), None, status_api, api_name="kernel_status",
                                       queue=False)
    demo.queue(default_concurrency_limit=2)
    return demo
