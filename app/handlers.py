"""The app's endpoints as plain functions of (settings, page values); errors become ``gr.Error`` messages.

``compare`` streams: one generator per configuration, advanced round-robin one token at a time so the
outputs grow side by side; each configuration's tokens/s counts only the time spent in its own steps.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from pathlib import Path

import gradio as gr
import pandas as pd

from toolkit.crash import one_line
from toolkit.crash import report as crash_report
from toolkit.errors import ToolkitError
from toolkit.model import SamplingParams, generate_tokens, load_config, perplexity
from toolkit.model.kv_cache import cache_bytes_per_token
from toolkit.quant import parse_policy
from toolkit.uqff import is_bundle, save_bundle

from .configs import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, Config, InputError, parse_configs, parse_count
from .models import COMPUTE, view
from .paths import bundle_under_root, list_bundles, under_root

log = logging.getLogger("app")
N_SLOTS = 4
FULL = Config("none", "moqe", "f32")  # the checkpoint as stored, f32 KV: what KLD is measured from
METRIC_COLUMNS = ["configuration", "tokens", "tok/s", "weight MB", "bits/weight", "KV B/token", "KV KB (context)", "model"]


def _user_error(e: Exception) -> gr.Error:
    if isinstance(e, ToolkitError):
        return gr.Error(one_line(e), print_exception=False)
    path = crash_report(e, "app request")
    log.error("internal error (%s: %s); full report in %s", type(e).__name__, one_line(e, 300), path)
    where = f" The full report is in {path}." if path else ""
    return gr.Error(f"internal error ({type(e).__name__}: {one_line(e, 300)}); the app keeps serving.{where}",
                    print_exception=False)


def friendly(fn):
    """Turn any exception of ``fn`` (function or generator) into a gr.Error: a message, never a stack trace."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*a, **k):
            try:
                yield from fn(*a, **k)
            except gr.Error:
                raise
            except Exception as e:
                raise _user_error(e) from None
        return gen

    @functools.wraps(fn)
    def call(*a, **k):
        try:
            return fn(*a, **k)
        except gr.Error:
            raise
        except Exception as e:
            raise _user_error(e) from None
    return call


def _rows(flat) -> list[tuple]:
    return [tuple(flat[3 * i: 3 * i + 3]) for i in range(len(flat) // 3)]


def _kv_bytes_per_token(model, kv: str) -> int:
    c = model.cfg
    return cache_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, (kv, kv))


def _metrics(cfg, loaded, cached, n_tokens, busy_s, ctx_tokens) -> dict:
    per_tok = _kv_bytes_per_token(loaded.model, cfg.kv)
    return {"configuration": cfg.label, "tokens": n_tokens,
            "tok/s": round(n_tokens / busy_s, 1) if busy_s > 0 and n_tokens else 0.0,
            "weight MB": round(loaded.weight_bytes / 1e6, 2), "bits/weight": round(loaded.bits_per_weight, 2),
            "KV B/token": per_tok, "KV KB (context)": round(per_tok * ctx_tokens / 1e3, 1),
            "model": "cached" if cached else f"loaded in {loaded.load_s:.1f} s"}


def _metrics_md(m: dict, ctx_tokens: int) -> str:
    return (f"**{m['tok/s']} tok/s** ({m['tokens']} tokens) · weights **{m['weight MB']} MB** "
            f"({m['bits/weight']} bits/weight) · KV **{m['KV B/token']} B/token**, "
            f"{m['KV KB (context)']} KB for {ctx_tokens} tokens · {m['model']}")


def compare(settings, cache, source, n, *rest):
    """rest = 4 x (format, policy, kv), prompt, max_new_tokens, temperature, seed.
    Yields (4 texts, 4 metric lines, metrics table)."""
    flat, (prompt, max_new, temperature, seed) = rest[: 3 * N_SLOTS], rest[3 * N_SLOTS:]
    configs = parse_configs(n, _rows(flat))
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("the prompt is empty; type a few words to continue")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"the prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    limit = min(MAX_NEW_TOKENS, settings.context - 1)
    max_new = parse_count(max_new, "max new tokens", 1, limit)
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise InputError(f"temperature must be a number, got {temperature!r}") from None
    if not 0 <= temperature <= 5:
        raise InputError(f"temperature must lie in [0, 5], got {temperature}")
    seed = parse_count(seed, "seed", 0, 2**32 - 1)

    with serving(cache):  # the warm-up pauses meanwhile; this request compiles what it uses (first run only)
        note = _first_use(cache)
        if note:
            yield (*([note] * len(configs) + [""] * (N_SLOTS - len(configs))), *([""] * N_SLOTS),
                   pd.DataFrame(columns=METRIC_COLUMNS))
        yield from _generate(settings, cache, source, configs, prompt, max_new, temperature, seed)


def _generate(settings, cache, source, configs, prompt, max_new, temperature, seed):
    loaded = [cache.get(source, c) for c in configs]  # [(Loaded, cached)]
    tok = loaded[0][0].tokenizer
    ids = tok.encode_for(prompt, loaded[0][0].model.cfg.vocab_size, "the prompt")
    if len(ids) + max_new > settings.context:
        raise InputError(f"the prompt is {len(ids)} tokens; with {max_new} new tokens that exceeds the context of "
                         f"{settings.context} tokens (shorten the prompt or ask for fewer tokens)")
    ctx_tokens = len(ids) + max_new
    k = len(configs)
    params = [SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed,
                             stop_token_ids=tuple(l.tokenizer.eos_token_ids)) for l, _ in loaded]
    gens = [generate_tokens(view(l, c.kv), [ids], p) for (l, _), c, p in zip(loaded, configs, params)]
    out_ids = [[] for _ in range(k)]
    busy = [0.0] * k
    live = list(range(k))

    def snapshot():
        texts = [loaded[i][0].tokenizer.decode(out_ids[i]) for i in range(k)] + [""] * (N_SLOTS - k)
        rows = [_metrics(configs[i], loaded[i][0], loaded[i][1], len(out_ids[i]), busy[i], ctx_tokens) for i in range(k)]
        mds = [_metrics_md(r, ctx_tokens) for r in rows] + [""] * (N_SLOTS - k)
        return (*texts, *mds, pd.DataFrame(rows, columns=METRIC_COLUMNS))

    yield snapshot()
    while live:
        for i in list(live):
            t0 = time.perf_counter()
            with COMPUTE:  # one token of one configuration
                ev = next(gens[i], None)
            busy[i] += time.perf_counter() - t0
            if ev is None:
                live.remove(i)
                continue
            out_ids[i].append(ev.token)
            if ev.done:
                live.remove(i)
        yield snapshot()


def serving(cache):
    """A request's hold on the kernel warm-up (``app/kernels.py``): it pauses while the request is served (every
    handler runs inside one: ``compare`` itself, the others from ``app/ui.py``)."""
    kernels = getattr(cache, "kernels", None)
    return kernels.serving() if kernels is not None else contextlib.nullcontext()


def _first_use(cache) -> str:
    kernels = getattr(cache, "kernels", None)
    return kernels.first_use() if kernels is not None else ""


def note_first_use(cache, progress) -> None:
    """On the progress bar: while the warm-up still runs, this request may compile its kernels (once)."""
    note = _first_use(cache)
    if note and progress is not None:
        progress(0, desc=note)


class _Steps:
    """A tqdm-like ``update`` that also reports ``done/total`` to a ``gr.Progress`` (when the page gave one)."""

    def __init__(self, progress, total: int, desc: str):
        self.progress, self.total, self.done, self.desc = progress, max(1, total), 0, desc
        self.report()

    def report(self):
        if self.progress is not None:
            self.progress((self.done, self.total), desc=self.desc, unit="steps")

    def update(self, n: int = 1):
        self.done += n
        self.report()


_HELDOUT: dict[tuple, list[int]] = {}


def _heldout_ids(settings, tok) -> list[int]:
    key = (str(settings.heldout), id(tok))
    if key not in _HELDOUT:
        _HELDOUT.clear()
        _HELDOUT[key] = tok.encode(Path(settings.heldout).read_text(encoding="utf-8"))
    return _HELDOUT[key]


def eval_ids(settings, tok, n_tokens) -> list[int]:
    """The first ``n_tokens`` held-out tokens: what Measure scores (the planner calibrates on later tokens)."""
    if not Path(settings.heldout).is_file():
        raise InputError(f"no held-out text at {settings.heldout}")
    return _heldout_ids(settings, tok)[:n_tokens]


def eval_windows(settings, n_tokens: int) -> int:
    """Disjoint windows of the context that ``n_tokens`` held-out tokens take (at most)."""
    return max(1, -(-(n_tokens - 1) // settings.context))


def reference_of(cache, source):
    """The full-precision model (f32 KV) that KLD is measured from; None for a UQFF bundle (no full-precision twin)."""
    return None if is_bundle(source) else view(cache.get(source, FULL)[0], "f32")


def score(settings, model, ids, reference, steps) -> tuple[dict, float]:
    """Held-out perplexity (and KLD from ``reference``) of ``model`` on ``ids``, disjoint windows of the context
    -> (``perplexity``'s result, seconds)."""
    t0 = time.perf_counter()
    with COMPUTE:
        r = perplexity(model, ids, settings.context, settings.context, progress=steps, reference=reference)
    return r, time.perf_counter() - t0


def measure(settings, cache, source, n, *rest, progress=None):
    """rest = 4 x (format, policy, kv), n_tokens -> (table, ppl-vs-bits frame, memory frame)."""
    flat, (n_tokens,) = rest[: 3 * N_SLOTS], rest[3 * N_SLOTS:]
    configs = parse_configs(n, _rows(flat))
    if not Path(settings.heldout).is_file():
        raise InputError(f"no held-out text at {settings.heldout}")
    n_tokens = parse_count(n_tokens, "held-out tokens", 16, 65536)
    window = settings.context
    note_first_use(cache, progress)
    steps = _Steps(progress, eval_windows(settings, n_tokens) * len(configs), "held-out perplexity")
    reference = reference_of(cache, source)
    rows, mem = [], []
    for c in configs:
        steps.desc = f"perplexity of {c.label}"
        loaded, cached = cache.get(source, c)
        r, dt = score(settings, view(loaded, c.kv), eval_ids(settings, loaded.tokenizer, n_tokens), reference, steps)
        per_tok = _kv_bytes_per_token(loaded.model, c.kv)
        kld = ({"KLD mean": round(r["kld_mean"], 6), "KLD p99": round(r["kld_p99"], 6),
                "top-1 agree %": round(100 * r["top1_agreement"], 2)} if reference is not None
               else {"KLD mean": "-", "KLD p99": "-", "top-1 agree %": "-"})
        rows.append({"configuration": c.label, "perplexity": round(r["perplexity"], 3), **kld, "tokens scored": r["tokens"],
                     "bits/weight": round(loaded.bits_per_weight, 3), "weight MB": round(loaded.weight_bytes / 1e6, 2),
                     "KV B/token": per_tok, f"KV MB @ {window}": round(per_tok * window / 1e6, 3),
                     "eval tok/s": round(r["tokens"] / dt, 1)})
        mem.append({"configuration": c.label, "part": "weights", "MB": loaded.weight_bytes / 1e6})
        mem.append({"configuration": c.label, "part": f"KV cache @ {window} tokens", "MB": per_tok * window / 1e6})
    table = pd.DataFrame(rows)
    return table, quality_plot(table), pd.DataFrame(mem)


def padded(values, frac: float = 0.1) -> list[float]:
    """Axis limits that show every value away from the frame: the data's range widened by ``frac`` on each side
    (a single value gets a range around it)."""
    lo, hi = float(min(values)), float(max(values))
    pad = (hi - lo) * frac if hi > lo else max(abs(hi) * frac, 0.5)
    return [lo - pad, hi + pad]


def quality_plot(table: pd.DataFrame):
    """Perplexity against bits per weight: every point inside the axes (scaled to the data, not from 0), the
    full-precision reference named as such."""
    pts = table[["configuration", "bits/weight", "perplexity"]].copy()
    pts["configuration"] = [c + " (reference)" if c.startswith("f32 (none)") else c for c in pts["configuration"]]
    return gr.ScatterPlot(value=pts, x_lim=padded(pts["bits/weight"]), y_lim=padded(pts["perplexity"]))


def refuse_bundle_source(source, what: str) -> None:
    if is_bundle(source):
        raise InputError(f"the model in use ({Path(source).name}) is a UQFF bundle; switch to the base model "
                         f"to {what} (a bundle is never requantized)")


def write_bundle(settings, cache, source, policy, name, progress=None) -> tuple[Path, str]:
    """Quantize ``source`` with ``policy`` into the bundle ``name`` under the output root (confined there; an
    existing folder only if it is empty or a bundle this toolkit wrote) -> (its path, a line saying what was saved)."""
    refuse_bundle_source(source, "quantize")
    out = under_root(settings.output_root, name)
    note_first_use(cache, progress)
    layers = load_config(source).num_layers
    t0 = time.perf_counter()
    with COMPUTE:
        report = save_bundle(source, out, policy, progress=_Steps(progress, layers, f"quantizing {policy.label}"))
    dt = time.perf_counter() - t0
    files = report.get("files", {}) if isinstance(report, dict) else {}
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return out, (f"Saved **{out.relative_to(Path(settings.output_root).resolve())}** ({policy.label}): "
                 f"{size / 1e6:.2f} MB on disk, {len(files) or '?'} files, in {dt:.1f} s.")


def bundle_choices(settings, out: Path):
    """The bundle picker (Quantize & save: "Load bundle" runs it in Compare), listing ``out`` and selecting it."""
    root = Path(settings.output_root).resolve()
    return gr.update(choices=list_bundles(settings.output_root), value=str(out.relative_to(root)))


def quantize_save(settings, cache, source, preset, fmt, name, progress=None):
    """Quantize the loaded checkpoint with (preset, fmt) into a bundle under the output root."""
    refuse_bundle_source(source, "quantize")
    if preset not in ("moqe", "all-linear"):
        raise InputError(f"unknown policy {preset!r}; choose moqe or all-linear")
    policy = parse_policy(preset, str(fmt or "").strip())
    out, msg = write_bundle(settings, cache, source, policy, name, progress)
    return msg, bundle_choices(settings, out)


def load_bundle(settings, cache, name):
    """-> (new model source, status)."""
    from .configs import Config

    path = bundle_under_root(settings.output_root, name)
    loaded, _ = cache.get(path, Config("none", "moqe", "f32"))
    return str(path), (f"Using bundle **{path.name}** ({loaded.report.policy}): weights "
                       f"{loaded.weight_bytes / 1e6:.2f} MB, {loaded.bits_per_weight:.2f} bits/weight. "
                       f"Run it with expert format `none` (a bundle runs as written).")


def use_base(settings):
    return str(Path(settings.model).resolve()), f"Using the base model **{settings.model}**."


def refresh_bundles(settings):
    return gr.update(choices=list_bundles(settings.output_root))
