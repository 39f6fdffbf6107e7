"""The Blocks page: shared configuration rows above three tabs (Compare, Measure, Quantize & save)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from toolkit.formats import FORMATS as REGISTRY  # noqa: E402

from . import handlers as h  # noqa: E402
from .configs import FORMATS, KV_TYPES, MAX_NEW_TOKENS, POLICIES, context_limit  # noqa: E402
from .kernels import KernelWarmup  # noqa: E402
from .models import COMPUTE, ModelCache  # noqa: E402

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
    context: int | None = None  # None: the checkpoint's training context (else max_position_embeddings)
    ppl_tokens: int = 1024  # default held-out tokens for Measure

    def __post_init__(self):
        self.model, self.output_root, self.heldout = Path(self.model), Path(self.output_root), Path(self.heldout)
        self.context = self.context or context_limit(self.model)


def _shown(path: Path) -> str:
    p = path.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def build_app(settings: AppSettings | None = None, warm: bool = True) -> gr.Blocks:
    """The page. ``warm``: start compiling every kernel the page can use in the background (``app/kernels.py``);
    requests that arrive before it is done wait for it and say so."""
    s = settings or AppSettings()
    s.output_root.mkdir(parents=True, exist_ok=True)
    cache = ModelCache(s.cache_size, s.backend)
    cache.kernels = KernelWarmup(s.backend, lock=COMPUTE)
    if warm:
        cache.kernels.start()
    else:
        cache.kernels.ready.set()
    base = str(s.model.resolve())

    with gr.Blocks(title="MoQE Toolkit: compare bit widths") as demo:
        demo.model_cache = cache  # for tests and introspection
        gr.Markdown(f"# MoQE Toolkit: compare expert bit widths\nModel **{_shown(s.model)}** · context **{s.context}** "
                    f"tokens · output root `{s.output_root.resolve()}` · up to {s.cache_size} models cached")
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
                            f"(disjoint windows of {s.context} tokens).")
                n_tok = gr.Number(s.ppl_tokens, label="Held-out tokens", precision=0)
                run = gr.Button("Measure", variant="primary")
                ppl = gr.Dataframe(label="Perplexity", interactive=False)
                with gr.Row():
                    scatter = gr.ScatterPlot(x="bits/weight", y="perplexity", color="configuration",
                                             title="Perplexity vs bits per weight")
                    bars = gr.BarPlot(x="configuration", y="MB", color="part", title="Memory per configuration")

            with gr.Tab("Quantize & save"):
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

        def show(k):
            k = int(k)
            return [gr.update(visible=i < k) for i in range(4)] * 2

        n.change(show, n, rows + cols, api_name=False, queue=False)

        def do_compare(src, k, *rest):
            yield from h.friendly(h.compare)(s, cache, src, k, *rest)

        def do_measure(src, k, *rest, progress=gr.Progress(track_tqdm=True)):
            return h.friendly(h.measure)(s, cache, src, k, *rest, progress=progress)

        def do_save(src, pre, fmt, name, progress=gr.Progress(track_tqdm=True)):
            return h.friendly(h.quantize_save)(s, cache, src, pre, fmt, name, progress=progress)

        def do_load(name):
            return h.friendly(h.load_bundle)(s, cache, name)

        go.click(do_compare, [source, n, *slots, prompt, max_new, temperature, seed], [*outs, *mds, table],
                 api_name="compare", concurrency_limit=4)
        run.click(do_measure, [source, n, *slots, n_tok], [ppl, scatter, bars], api_name="measure")
        save.click(do_save, [source, q_pre, q_fmt, q_name], [save_md, pick], api_name="quantize_save")
        load.click(do_load, [pick], [source, status], api_name="load_bundle")
        use_base.click(lambda: h.use_base(s), None, [source, status], api_name="use_base_model")
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
