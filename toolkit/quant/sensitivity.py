"""Per-expert sensitivity: what each routed expert's gate/up and down cost, at each candidate format, on the
tokens routed to it (the planner's input, ``toolkit/quant/plan.py``).

Calibration runs the full-precision model over calibration text (held out from evaluation: by default the
held-out text's tokens from ``CALIBRATION_START`` on, while evaluation scores its first 8,192) and records,
at every MoE layer, the layer input ``x [T, D]`` and the routing (``ids``, ``weights [T, A]``). Then for each
expert ``e`` and projection ``p``, quantizing ``p`` alone at format ``f``:

    loss[e, p, f] = sum over tokens t routed to e of  w_t^2 * ||y_e(x_t) - y_e^(p@f)(x_t)||^2

(``y_e`` the expert's SwiGLU output; ``w_t`` its routing weight): the squared error the layer's output takes
from that choice, summed over the calibration tokens. The planner adds these up across experts and
projections (errors of different experts land on different tokens or add up with random signs).

An expert that calibration routes fewer than ``min_tokens`` tokens to is measured on tokens forced through
it: the calibration tokens its router score ranks highest, weighted by their softmax probability for it.
Its measured loss per token is then scaled to its observed routing count (at least one token), so a rarely
used expert is cheap to quantize hard, but it is never left unmeasured.

Each format is tried twice where it can be: with round-to-nearest scales and with scales calibrated on the
expert's own inputs (``toolkit/quant/imatrix.py``); the lower measured loss is kept, and which one it was
(``Sensitivity.calibrated``), so quantizing with the plan reproduces what was measured.

Last, ``layer_factors`` turns the summed output errors into predicted KLD: one factor per layer and
projection, the KL divergence measured with that part alone at ``PROBE`` over the loss predicted for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelError
from ..formats import Format, QTensor, get_format
from ..formats.mixed import stack_experts
from .imatrix import calibrated, quantize_weighted

CALIBRATION_START = 8192  # the held-out text's tokens [8192, ...) calibrate; [0, 8192) evaluate (bench quality)
CALIBRATION_TOKENS = 0  # 0: every token from the start on
# the candidate formats of an expert projection (those whose group size divides its inner dimension are used)
CANDIDATES = ("int8", "q8_0", "int4-g32", "int4-g64", "int4-g128", "q4_0", "int3-g32", "int3-g64", "int3-g128",
              "int2-g32", "int2-g64", "int2-g128")
PROJECTIONS = ("gate_up", "down")
PROBE, PROBE_TOKENS = "int2-g64", 1024  # each layer's KLD factor: its experts alone at PROBE, over PROBE_TOKENS


@dataclass
class ExpertStats:
    """Routing of one expert over the calibration tokens."""

    tokens: int  # routed to it
    weight_sum: float  # sum of its routing weights
    forced: int = 0  # tokens forced through it to measure it (0: measured on its routed tokens)


@dataclass
class Sensitivity:
    """``loss[(layer, proj, e)][fmt spec]`` and ``nbytes[(layer, proj, e)][fmt spec]``, with routing stats."""

    model: str
    calibration: str  # what text and tokens
    tokens: int
    formats: tuple[str, ...]
    stats: dict = field(default_factory=dict)  # (layer, e) -> ExpertStats
    loss: dict = field(default_factory=dict)
    nbytes: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)  # (layer, proj, e) -> [N, K]
    factors: dict = field(default_factory=dict)  # (layer, proj) -> KLD per unit of output error (empty: raw losses)
    imatrix: dict = field(default_factory=dict)  # (layer, proj, e) -> importance [K] (empty: round-to-nearest scales)
    calibrated: dict = field(default_factory=dict)  # (layer, proj, e) -> formats whose calibrated scales measured better
    rtn: dict = field(default_factory=dict)  # like ``loss``, with round-to-nearest scales throughout

    def importance(self, key, fmt: str):
        """The importance to quantize item ``key`` at ``fmt`` with: None where round-to-nearest measured better."""
        return self.imatrix.get(key) if fmt in self.calibrated.get(key, ()) else None

    def items(self) -> list[tuple[int, str, int]]:
        return sorted(self.loss)

    def to_json(self) -> dict:
        key = lambda k: f"layers.{k[0]}.moe.{k[1]}.{k[2]}"
        from ..writes import WRITER

        return {"writer": WRITER, "model": self.model, "calibration": self.calibration, "tokens": self.tokens, "formats": list(self.formats),
                "loss": "predicted mean KLD" if self.factors else "summed squared output error",
                "layer_factors": {f"layers.{i}.moe.{p}": v for (i, p), v in sorted(self.factors.items())},
                "experts": [{"layer": i, "expert": e, "tokens": s.tokens, "weight_sum": s.weight_sum, "forced": s.forced}
                            for (i, e), s in sorted(self.stats.items())],
                "items": [{"name": key(k), "shape": self.shapes[k], "loss": self.loss[k], "bytes": self.nbytes[k],
                           "calibrated": sorted(self.calibrated.get(k, ())), "loss_rtn": self.rtn.get(k, {})}
                          for k in self.items()]}


def from_json(d: dict, where: str = "sensitivity file") -> Sensitivity:
    """The inverse of :meth:`Sensitivity.to_json` (``moqe plan --reuse``). Every number is checked (finite, in
    range, whole where it counts), every format known, every item's bytes exactly what its format takes at its
    shape; anything else is a ModelError naming the file and the entry."""
    from ..errors import ToolkitError
    from ..numbers import real, whole
    from .keys import key_of

    def fail(msg):
        raise ModelError(f"{where}: {msg} (not a sensitivity table written by moqe plan)")

    def get(obj, key, kind, ctx):
        if not isinstance(obj, dict) or key not in obj:
            fail(f"{ctx} has no {key!r}")
        v = obj[key]
        if kind is not None and not isinstance(v, kind):
            fail(f"{ctx}: {key!r} must be {'a list' if kind is list else 'an object' if kind is dict else 'a string'}")
        return v

    try:
        formats = get(d, "formats", list, "the table")
        if not formats or not all(isinstance(f, str) for f in formats) or len(set(formats)) != len(formats):
            fail("'formats' must be a non-empty list of distinct format names")
        fmts = {f: get_format(f) for f in formats}
        sens = Sensitivity(get(d, "model", str, "the table"), get(d, "calibration", str, "the table"),
                           whole(get(d, "tokens", None, "the table"), "'tokens'"), tuple(formats))
        factors = d.get("layer_factors", {})
        if not isinstance(factors, dict):
            fail("'layer_factors' must be an object")
        for k, v in factors.items():
            i, p, _ = key_of(f"{k}.0", f"layer factor {k!r}")
            sens.factors[(i, p)] = real(v, f"layer factor {k!r}", 0, 1e30)
        for n, x in enumerate(get(d, "experts", list, "the table")):
            ctx = f"experts[{n}]"
            key = (whole(get(x, "layer", None, ctx), f"{ctx}.layer", 0, 999_999_999),
                   whole(get(x, "expert", None, ctx), f"{ctx}.expert", 0, 999_999_999))
            if key in sens.stats:
                fail(f"{ctx}: layer {key[0]} expert {key[1]} is listed twice")
            sens.stats[key] = ExpertStats(whole(get(x, "tokens", None, ctx), f"{ctx}.tokens"),
                                          real(get(x, "weight_sum", None, ctx), f"{ctx}.weight_sum", 0, 1e30),
                                          whole(get(x, "forced", None, ctx), f"{ctx}.forced"))
        for n, it in enumerate(get(d, "items", list, "the table")):
            ctx = f"items[{n}]"
            key = key_of(get(it, "name", str, ctx), f"{ctx}.name")
            if key in sens.loss:
                fail(f"{ctx}: {it['name']!r} is listed twice")
            shape = get(it, "shape", list, ctx)
            if len(shape) != 2:
                fail(f"{ctx}: 'shape' must be [N, K]")
            shape = [whole(v, f"{ctx}.shape", 1, 1 << 24) for v in shape]
            loss, nbytes, rtn = get(it, "loss", dict, ctx), get(it, "bytes", dict, ctx), it.get("loss_rtn", None)
            sens.shapes[key] = shape
            sens.loss[key] = {f: real(get(loss, f, None, f"{ctx}.loss"), f"{ctx}.loss[{f!r}]", 0, 1e30) for f in formats}
            sens.nbytes[key] = {}
            for f in formats:
                b = whole(get(nbytes, f, None, f"{ctx}.bytes"), f"{ctx}.bytes[{f!r}]", 1)
                if b != fmts[f].nbytes(tuple(shape)):
                    fail(f"{ctx}: bytes[{f!r}] is {b:,}, but {f} at shape {shape} takes {fmts[f].nbytes(tuple(shape)):,}")
                sens.nbytes[key][f] = b
            if rtn is None:
                sens.rtn[key] = dict(sens.loss[key])
            else:
                if not isinstance(rtn, dict):
                    fail(f"{ctx}: 'loss_rtn' must be an object")
                sens.rtn[key] = {f: real(get(rtn, f, None, f"{ctx}.loss_rtn"), f"{ctx}.loss_rtn[{f!r}]", 0, 1e30)
                                 for f in formats}
            cal = it.get("calibrated", [])
            if not isinstance(cal, list) or not all(isinstance(f, str) and f in fmts for f in cal):
                fail(f"{ctx}: 'calibrated' must list formats of the table's 'formats'")
            if cal:
                sens.calibrated[key] = set(cal)
    except ToolkitError as e:
        if isinstance(e, ModelError) and str(e).startswith(str(where)):
            raise
        raise ModelError(f"{where}: {e}") from None
    if not sens.loss:
        fail("'items' is empty")
    return sens


def check_table(sens: Sensitivity, cfg, where: str) -> None:
    """A reused table must describe exactly this model's routed expert projections, at their shapes."""
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate
    want = {(i, p, e): ([2 * I, D] if p == "gate_up" else [D, I])
            for i in range(cfg.num_layers) if cfg.moe_layers[i] for p in PROJECTIONS for e in range(E)}
    extra = sorted(set(sens.loss) - set(want))
    if extra:
        i, p, e = extra[0]
        raise ModelError(f"{where}: item layers.{i}.moe.{p}.{e} is not a routed expert projection of the model "
                         f"({len(want)} expected; {len(extra)} item(s) that the model lacks)")
    missing = sorted(set(want) - set(sens.loss))
    if missing:
        i, p, e = missing[0]
        raise ModelError(f"{where}: no item for layers.{i}.moe.{p}.{e} ({len(missing)} of the model's {len(want)} "
                         f"expert projections missing)")
    for k, shape in want.items():
        if sens.shapes[k] != shape:
            i, p, e = k
            raise ModelError(f"{where}: layers.{i}.moe.{p}.{e} has shape {sens.shapes[k]}; the model's is {shape}")


def _swiglu(x, gu):  # x [n, D], gu [2I, D] -> [n, I]
    h = x @ gu.T
    g, u = np.split(h, 2, axis=1)
    return g / (1 + np.exp(-g)) * u


def candidates(shape_in: dict[str, int], names=CANDIDATES) -> list[Format]:
    """The candidate formats whose group size divides every inner dimension (``{proj: K}``)."""
    out = []
    for n in names:
        f = get_format(n)
        if all(k % (f.group_size or 1) == 0 for k in shape_in.values()) and f.uqff_tag is not None:
            out.append(f)
    return out


def record_layers(model, ids: np.ndarray, window: int) -> dict[int, list]:
    """Run ``model`` over ``ids`` in disjoint windows; ``{layer: [(x [T, D], ids [T, A], weights [T, A])]}``
    at every MoE layer (the experts' own inputs)."""
    from .trace import watching_experts

    seen: dict[int, list] = {}
    rt = model.rt

    def see(i, x, ids_, wts):
        seen.setdefault(i, []).append((rt.host(x).copy(), rt.host(ids_).copy(), rt.host(wts).copy()))

    with watching_experts(model, see):
        for begin in range(0, len(ids), window):
            chunk = np.asarray(ids[begin:begin + window], np.int64)
            if len(chunk) < 2:
                break
            model.forward(chunk[None], model.new_cache(1, len(chunk)))
    return seen


def measure(model, weights, ids, window: int = 256, formats=CANDIDATES, min_tokens: int = 32, progress=None,
            model_name: str = "", calibration: str = "", imatrix: bool = True) -> Sensitivity:
    """Sensitivity of every routed expert projection of ``model`` (full precision, ``weights`` its
    ``ModelWeights`` in f32) at each of ``formats``, calibrated on ``ids``."""
    cfg = model.cfg
    seen = record_layers(model, ids, window)
    if not seen:
        raise ModelError("the model has no routed-expert layer to plan")
    fmts = candidates({"gate_up": cfg.hidden_size, "down": cfg.expert_intermediate}, formats)
    if not fmts:
        raise ModelError(f"none of the formats {', '.join(formats)} fits hidden size {cfg.hidden_size} and expert "
                         f"size {cfg.expert_intermediate}")
    sens = Sensitivity(model_name, calibration, len(ids), tuple(f.spec for f in fmts))
    for i in sorted(seen):
        x = np.concatenate([r[0] for r in seen[i]])  # [T, D]
        tid = np.concatenate([r[1] for r in seen[i]])  # [T, A]
        tw = np.concatenate([r[2] for r in seen[i]]).astype(np.float32)  # [T, A]
        m = weights.layers[i].moe
        gate_up, down = (w.dequantize("numpy") if isinstance(w, QTensor) else np.asarray(w, np.float32)
                         for w in (m["gate_up"], m["down"]))  # [E, 2I, D], [E, D, I]
        logits = x @ np.asarray(m["router"], np.float32).T  # [T, E]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        for e in range(cfg.num_experts):
            t, a = np.nonzero(tid == e)
            w = tw[t, a]
            stats = ExpertStats(len(t), float(w.sum()))
            scale = 1.0
            if len(t) < min_tokens:  # too few to measure: force the tokens whose router ranks e highest
                routed = set(t.tolist())
                extra = [j for j in np.argsort(-probs[:, e], kind="stable") if j not in routed][: min_tokens - len(t)]
                t = np.concatenate([t, np.asarray(extra, np.int64)])
                w = np.concatenate([w, probs[extra, e].astype(np.float32)])
                stats.forced = len(extra)
                scale = max(stats.tokens, 1) / len(t)  # per measured token -> per routed token (at least one)
            sens.stats[(i, e)] = stats
            xe = x[t]  # [n, D]
            ww = (w.astype(np.float64) ** 2)[:, None]
            he = _swiglu(xe, gate_up[e])  # [n, I]
            y = he @ down[e].T  # [n, D]
            for proj, wfull, inp in (("gate_up", gate_up[e], xe), ("down", down[e], he)):
                key = (i, proj, e)
                imp = (inp.astype(np.float64) ** 2).mean(axis=0).astype(np.float32) if imatrix else None  # [K]
                if imp is not None:
                    sens.imatrix[key] = imp
                sens.shapes[key] = list(wfull.shape)
                sens.loss[key], sens.nbytes[key] = {}, {}
                for f in fmts:
                    losses = []
                    for im in (None, imp) if imp is not None and calibrated(f) else (None,):
                        wq = quantize_weighted(f, wfull, im, "numba").dequantize("numpy")
                        yq = _swiglu(xe, wq) @ down[e].T if proj == "gate_up" else he @ wq.T
                        losses.append(float(scale * (ww * (y - yq).astype(np.float64) ** 2).sum()))
                    best = int(np.argmin(losses))  # calibrated scales only where they lower the expert's output error
                    sens.loss[key][f.spec] = losses[best]
                    sens.rtn.setdefault(key, {})[f.spec] = losses[0]
                    if best:
                        sens.calibrated.setdefault(key, set()).add(f.spec)
                    sens.nbytes[key][f.spec] = int(f.nbytes(wfull.shape))
            if progress is not None:
                progress.update(1)
    return sens


def _logprobs(model, ids, window: int) -> list[np.ndarray]:
    """Log-probabilities of every next token, window by window (disjoint windows): ``[[n-1, V]]`` float64."""
    from ..model.generate import _host_logits, _log_softmax

    out = []
    for begin in range(0, len(ids), window):
        chunk = np.asarray(ids[begin:begin + window], np.int64)
        if len(chunk) < 2:
            break
        logits = model.forward(chunk[None], model.new_cache(1, len(chunk)))
        out.append(_log_softmax(_host_logits(model, logits)[:-1]))
    return out


def _kld(ref: list, got: list) -> float:
    """Mean KL(P_ref || P) over the positions."""
    total = sum(float((np.exp(p) * (p - q)).sum()) for p, q in zip(ref, got))
    return total / sum(len(p) for p in ref)


def layer_factors(cfg, weights, sens: Sensitivity, ids, window: int, probe: str, backend: str = "numba") -> dict:
    """Per MoE layer ``i`` and projection ``p``: the measured mean KLD with only ``p`` of layer i's experts at
    format ``probe``, divided by the summed output error the sensitivity predicts for that same choice.
    Multiplying a loss by its factor turns it into predicted KLD: the factor carries what the output error alone
    cannot see, how much the rest of the network amplifies an error made at that depth, and in which directions
    (gate/up errors lie in the expert's own output directions, down's rounding spreads over all of them: on the
    bundled model gate/up's factor is about twice down's)."""
    import dataclasses

    from ..model import MoEModel

    f = get_format(probe)
    codec = "numpy" if backend == "numpy" else "numba"
    ref = _logprobs(MoEModel(cfg, weights, backend), ids, window)
    out = {}
    for i, proj in sorted({k[:2] for k in sens.loss}):
        layers = list(weights.layers)
        moe = dict(layers[i].moe)
        w = np.asarray(moe[proj], np.float32)  # [E, N, K]
        moe[proj] = stack_experts([quantize_weighted(f, w[e], sens.importance((i, proj, e), f.spec), codec) for e in range(len(w))])
        layers[i] = dataclasses.replace(layers[i], moe=moe)
        model = MoEModel(cfg, dataclasses.replace(weights, layers=layers), backend)
        kld = _kld(ref, _logprobs(model, ids, window))
        predicted = sum(v[f.spec] for k, v in sens.loss.items() if k[:2] == (i, proj))
        out[(i, proj)] = kld / predicted if predicted > 0 else 0.0
    return out


def spread(ids, n: int, window: int):
    """About ``n`` of ``ids`` as whole windows spread evenly over them (not just their start)."""
    wins = [ids[b:b + window] for b in range(0, len(ids), window)]
    if len(ids) <= n or not wins:
        return ids
    keep = np.unique(np.linspace(0, len(wins) - 1, max(1, n // window)).round().astype(int))
    return [t for k in keep for t in wins[k]]


def calibration_ids(tok, cfg, text: str, where: str, start: int = CALIBRATION_START, tokens: int = CALIBRATION_TOKENS):
    """Tokens ``[start, start + tokens)`` of ``text``; refuses a text too short to give any."""
    ids = tok.encode_for(text, cfg.vocab_size, where)
    if len(ids) < start + 2:
        raise ModelError(f"{where}: {len(ids)} tokens; calibration starts at token {start} (lower --calib-start, "
                         f"or give a longer text)")
    return ids[start:start + tokens] if tokens else ids[start:]


def calibrate(model_dir, text_path, start: int = CALIBRATION_START, tokens: int = CALIBRATION_TOKENS,
              formats=CANDIDATES, window: int = 256, backend: str = "numba", progress=None,
              allow_outside: bool = False, probe: str | None = PROBE, probe_tokens: int = PROBE_TOKENS) -> Sensitivity:
    """Load ``model_dir`` in full precision, calibrate on ``text_path`` and measure every expert projection."""
    from ..files import read_text
    from ..model import Checkpoint, MoEModel, Tokenizer, load_config, load_weights

    cfg = load_config(model_dir, allow_outside)
    if cfg.num_experts < 2 or not any(cfg.moe_layers):
        raise ModelError(f"{model_dir}: no routed experts to plan")
    if cfg.expert_act is not None:
        raise ModelError(f"{model_dir}: its experts are not plain SwiGLU ({cfg.expert_act[0]}, with biases); the planner "
                         f"measures and mixes plain SwiGLU experts only")
    tok = Tokenizer(model_dir, cfg.bos_token_id, cfg.eos_token_ids, allow_outside)
    ids = calibration_ids(tok, cfg, read_text(text_path, "calibration text"), str(text_path), start, tokens)
    weights = load_weights(Checkpoint(model_dir, allow_outside), cfg)
    model = MoEModel(cfg, weights, backend)
    what = f"{text_path} tokens [{start}, {start + len(ids)})"
    window = min(window, cfg.max_position_embeddings)
    sens = measure(model, weights, ids, window, formats, progress=progress, model_name=str(model_dir), calibration=what)
    if probe and probe not in sens.formats:  # the probe was not a candidate: the smallest candidate probes
        probe = min(sens.formats, key=lambda f: get_format(f).nbytes((cfg.hidden_size, cfg.expert_intermediate)))
    if probe:  # output error -> predicted KLD, one factor per layer and projection
        sens.factors = layer_factors(cfg, weights, sens, spread(ids, probe_tokens, window), window, probe, backend)
        for k, v in sens.loss.items():
            sens.loss[k] = {f: x * sens.factors[k[:2]] for f, x in v.items()}
            sens.rtn[k] = {f: x * sens.factors[k[:2]] for f, x in sens.rtn[k].items()}
    return sens
