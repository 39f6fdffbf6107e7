"""The bit-budget planner: one format per routed expert projection, total bytes under a budget, least
predicted loss (a multiple-choice knapsack), written as a plan file that ``moqe quantize --plan`` reads.

Plan file: one ``layers.{i}.moe.{gate_up|down}.{e}=FORMAT`` line per expert projection (the override
language's per-expert names, ``toolkit/quant/policy.py``); ``#`` starts a comment. Every expert projection of
the model must be named exactly once. A ``#! imatrix=FILE`` line names the importance file (beside the plan)
whose calibrated scales the plan was measured with; quantizing with the plan uses it too.

The solver is exact dynamic programming over bytes counted in units of ``unit`` bytes, each item's bytes
rounded *up* to whole units (so the plan never exceeds the budget; it can leave under one unit per item
unused). Items are (layer, projection, expert); choices are the candidate formats with their measured loss.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError
from ..formats import get_format
from .imatrix import load_imatrix, save_imatrix
from .keys import NAME, key_of
from .policy import Policy

MAX_UNITS = 1 << 16  # DP width: the byte unit is chosen so the budget spans at most this many units


@dataclass(frozen=True)
class Choice:
    fmt: str
    nbytes: int
    loss: float


def solve(items: dict, budget: int, max_units: int = MAX_UNITS) -> dict:
    """``items {key: [Choice]}``, ``budget`` bytes -> ``{key: Choice}`` minimising the summed loss with the
    summed bytes <= budget. Raises FormatError naming the smallest possible total when even the cheapest choice
    of every item does not fit."""
    keys = sorted(items)
    if not keys:
        raise FormatError("nothing to plan: no expert projections")
    floor = sum(min(c.nbytes for c in items[k]) for k in keys)
    if floor > budget:
        raise FormatError(f"a budget of {budget:,} bytes is too small: the smallest formats of every expert projection "
                          f"take {floor:,} bytes ({floor / 1e6:.3f} MB)")
    # bytes above each item's cheapest choice, in units: the DP only spans the spare budget
    spare = budget - floor
    max_units = min(max_units, max(1024, (1 << 27) // len(keys)))  # the choice table: <= 256 MB of int16
    unit = max(1, -(-spare // max_units))
    cap = spare // unit
    best = np.zeros(cap + 1)  # best[b]: least loss using <= b spare units (items so far)
    picks = []
    for k in keys:
        base = min(c.nbytes for c in items[k])
        cand = sorted(items[k], key=lambda c: (c.nbytes, c.loss))
        new = np.full(cap + 1, np.inf)
        arg = np.full(cap + 1, -1, np.int16)
        for j, c in enumerate(cand):
            w = -(-(c.nbytes - base) // unit)
            if w > cap:
                continue
            val = np.full(cap + 1, np.inf)
            val[w:] = best[: cap + 1 - w] + c.loss
            better = val < new
            new[better], arg[better] = val[better], j
        best = new
        picks.append((k, cand, arg))
    b = int(np.argmin(best))  # the least loss (any spare budget; ties: the fewest bytes)
    out = {}
    for k, cand, arg in reversed(picks):
        c = cand[int(arg[b])]
        out[k] = c
        b -= -(-(c.nbytes - min(x.nbytes for x in cand)) // unit)
    return out


def items_from(sens) -> dict:
    """The knapsack items of a :class:`~toolkit.quant.sensitivity.Sensitivity`: ``{name: [Choice]}``."""
    return {f"layers.{i}.moe.{p}.{e}": [Choice(f, sens.nbytes[(i, p, e)][f], sens.loss[(i, p, e)][f]) for f in sens.formats]
            for (i, p, e) in sens.items()}


def rtn_loss(sens, fmt: str) -> float:
    """Predicted loss of one format everywhere with round-to-nearest scales (no calibration)."""
    return sum(v[fmt] for v in sens.rtn.values()) if sens.rtn else sum(v[fmt] for v in sens.loss.values())


def uniform(items: dict, fmt: str) -> tuple[int, float]:
    """(bytes, predicted loss) of one format everywhere (calibrated scales where they measured better)."""
    cs = [next(c for c in items[k] if c.fmt == fmt) for k in items]
    return sum(c.nbytes for c in cs), sum(c.loss for c in cs)


# ---- the plan file ---------------------------------------------------------------------------------------
def plan_text(plan: dict, header: list[str], imatrix: str | None = None, host=None) -> str:
    """``plan {name: Choice or format}`` -> the plan file's text (its first line is the toolkit's plan mark).
    ``imatrix``: the importance file (a name relative to the plan's folder) whose calibrated scales it was
    measured with. ``host [L, E]`` (the joint planner's places): each line gains a place column, ``host`` or
    ``device`` (``layers.0.moe.down.3=q4_0 host``), which ``--plan`` on cuda / cuda-emu applies."""
    from ..writes import PLAN_MARK

    first = header[0] if header else ""
    if not f"# {first}".startswith(PLAN_MARK):
        header = ["moqe plan", *header]
    lines = [f"# {h}" for h in header] + ([f"#! imatrix={imatrix}"] if imatrix else [])
    for name in sorted(plan, key=_order):
        c = plan[name]
        place = ""
        if host is not None:
            i, _, e = key_of(name, "plan")
            place = " host" if host[i, e] else " device"
        lines.append(f"{name}={c.fmt if isinstance(c, Choice) else c}{place}")
    return "\n".join(lines) + "\n"


def write_plan(path, plan: dict, header: list[str], imatrix: str | None = None, host=None) -> None:
    """Write the plan file (atomically). The caller has applied the write rule to ``path``."""
    from ..writes import atomic_write_text

    atomic_write_text(Path(path), plan_text(plan, header, imatrix, host))


def _order(name: str):
    m = NAME.match(name)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else (1 << 30, name, 0)


def parse_plan(text: str, cfg, where: str = "plan") -> dict[str, object]:
    """Plan text -> ``{name: Format}`` for the model ``cfg``. Refuses unknown formats, names that are not an
    expert projection of the model, duplicates, formats that do not fit the projection, and missing names; the
    message names the file and line."""
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate
    moe_layers = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    out, line_of = {}, {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, spec = line.partition("=")
        name, spec = name.strip(), spec.strip()
        spec, _, place = spec.partition(" ")
        if place.strip() not in ("", "host", "device"):
            raise FormatError(f"{where}, line {n}: {raw.strip()!r}: the place column must be host or device, "
                              f"not {place.strip()!r}")
        if not sep or not name or not spec:
            raise FormatError(f"{where}, line {n}: {raw.strip()!r} must look like layers.I.moe.gate_up.E=FORMAT")
        i, proj, e = key_of(name, f"{where}, line {n}")
        if i not in moe_layers:
            raise FormatError(f"{where}, line {n}: {name!r}: the model has no MoE layer {i} "
                              f"(MoE layers: {moe_layers[0]}..{moe_layers[-1]})" if moe_layers else
                              f"{where}, line {n}: the model has no MoE layer")
        if e >= E:
            raise FormatError(f"{where}, line {n}: {name!r}: the model has {E} experts per layer (0..{E - 1})")
        if name in out:
            raise FormatError(f"{where}, line {n}: {name!r} is already planned on line {line_of[name]}")
        try:
            fmt = None if spec.lower() in ("none", "f32") else get_format(spec)
            if fmt is not None:
                fmt.check_shape((2 * I, D) if proj == "gate_up" else (D, I), name)
        except FormatError as err:
            raise FormatError(f"{where}, line {n}: {err}") from None
        out[name], line_of[name] = fmt, n
    want = [f"layers.{i}.moe.{p}.{e}" for i in moe_layers for p in ("gate_up", "down") for e in range(E)]
    missing = [w for w in want if w not in out]
    if missing:
        raise FormatError(f"{where}: {len(missing)} expert projection(s) have no line, e.g. {missing[0]!r} "
                          f"(a plan names all {len(want)})")
    return out


def plan_places(text: str, cfg, where: str = "plan") -> np.ndarray | None:
    """The place column of a plan's text -> host mask ``[L, E]`` (None when no line has one). Both projections
    of an expert must name one place; a plan that places some lines must place all."""
    parse_plan(text, cfg, where)  # names, formats and places checked line by line first
    host, seen, placed = np.zeros((cfg.num_layers, cfg.num_experts), bool), {}, 0
    lines = [(n, raw.split("#", 1)[0].strip()) for n, raw in enumerate(text.splitlines(), 1)]
    lines = [(n, l) for n, l in lines if l]
    for n, line in lines:
        name, _, spec = line.partition("=")
        place = spec.strip().partition(" ")[2].strip()
        if not place:
            continue
        placed += 1
        i, _, e = key_of(name.strip(), f"{where}, line {n}")
        if (i, e) in seen and seen[i, e][1] != place:
            raise FormatError(f"{where}, line {n}: expert {e} of layer {i} is placed on the {place} here and on the "
                              f"{seen[i, e][1]} on line {seen[i, e][0]} (both projections of an expert live together)")
        seen[i, e] = (n, place)
        host[i, e] = place == "host"
    if placed and placed != len(lines):
        raise FormatError(f"{where}: {placed} of {len(lines)} lines have a place column; give one on every line or none")
    return host if placed else None


def plan_policy(path, cfg) -> Policy:
    """A plan file -> the Policy that quantizes every expert projection as planned (``moqe quantize --plan``). The
    importance file a ``#! imatrix=NAME`` line names is read from the plan's own folder (the read rule of
    :class:`toolkit.files.Folder`: a plain relative name, no ``..``, no link out of the folder)."""
    from ..files import read_text

    text = read_text(path, "plan file")
    plan = parse_plan(text, cfg, str(path))
    imatrix, imatrix_label = None, ""
    for n, name in imatrix_lines(text):

        if imatrix is not None:
            raise FormatError(f"{path}, line {n}: a second '#! imatrix=' line (a plan names one importance file)")
        where = importance_beside(path, name, f"{path}, line {n}")
        imatrix = load_imatrix(where)
        imatrix_label = f"{name}#{hashlib.sha256(where.read_bytes()).hexdigest()[:8]}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return _policy(tuple(plan.items()), f"{Path(path).name}#{digest}", imatrix, imatrix_label)


def imatrix_lines(text: str) -> list[tuple[int, str]]:
    """The ``#! imatrix=NAME`` lines of a plan's text: ``[(line number, NAME)]``."""
    return [(n, line[2:].strip()[len("imatrix="):].strip()) for n, line in enumerate(text.splitlines(), 1)
            if line.startswith("#!") and line[2:].strip().startswith("imatrix=")]


def importance_beside(path, name, where: str) -> Path:
    """The importance file ``name`` that a plan or a sensitivity table at ``path`` names: read only from that
    file's own folder (:class:`toolkit.files.Folder`'s rule: a plain relative name, no link leaving the folder)."""
    from ..files import Folder, check_name

    folder = Folder(Path(path).parent)
    check_name(name, where)
    if not folder.exists(name):
        raise FormatError(f"{path}: names the importance file {name!r}, which is not in {folder.dir} "
                          f"(keep it beside the plan)")
    return folder.path(name, where, "importance file")


def _policy(entries: tuple, label: str, imatrix: dict | None, imatrix_label: str) -> Policy:
    """The Policy of plan ``entries`` ((name, Format or None), ...): the moqe preset at the plan's most common format
    (what its label shows), every expert projection looked up in the plan."""
    specs = [f.spec if f else "none" for _, f in entries]
    common = max(dict.fromkeys(specs), key=specs.count)  # ties: the first in plan order
    return Policy("moqe", None if common == "none" else get_format(common), plan=entries, plan_label=label,
                  imatrix=imatrix or None, imatrix_label=imatrix_label if imatrix else "")


def plan_importance(plan: dict, sens) -> dict:
    """The calibrated importance of each planned item whose chosen format measured better with it:
    ``{(layer, proj, e): [K]}`` (empty without a Sensitivity)."""
    out = {}
    for n, c in plan.items() if sens is not None else ():
        imp = sens.importance(key_of(n), c.fmt if isinstance(c, Choice) else str(c))
        if imp is not None:
            out[key_of(n)] = imp
    return out


def policy_of(plan: dict, sens=None, label: str = "plan") -> Policy:
    """An in-memory plan ``{name: Choice or format spec}`` -> its Policy; with ``sens`` (the Sensitivity it was
    solved from), the calibrated scales of the items whose chosen format measured better with them."""
    def fmt(c):
        spec = c.fmt if isinstance(c, Choice) else c
        return None if spec is None or str(spec).lower() in ("none", "f32") else get_format(spec)

    entries = tuple((n, fmt(c)) for n, c in sorted(plan.items(), key=lambda kv: _order(kv[0])))
    digest = hashlib.sha256("\n".join(f"{n}={f.spec if f else 'none'}" for n, f in entries).encode()).hexdigest()[:8]
    return _policy(entries, f"{label}#{digest}", plan_importance(plan, sens), f"{label}#{digest}")


def solve_bits(sens, bits_per_weight: float) -> dict:
    """The plan of ``sens`` at an average of ``bits_per_weight`` stored bits per routed expert weight."""
    params = sum(int(np.prod(s)) for s in sens.shapes.values())
    return solve(items_from(sens), int(bits_per_weight * params / 8))


def imatrix_path(path) -> Path:
    """The calibrated scales' file beside a plan (or a sensitivity table): ``<name>.imatrix.safetensors``."""
    path = Path(path)
    return path.parent / (path.name + ".imatrix.safetensors")


def plan_files(path, plan: dict, sens, header: list[str], host=None) -> tuple[dict, int]:
    """The files of a plan for :func:`toolkit.writes.publish`: ``({target: write(tmp)}, items using calibrated
    scales)``: the plan file and, when any planned item uses calibrated scales, its importance file beside it."""

    path = Path(path)
    kept = plan_importance(plan, sens)
    files, name = {}, None
    if kept:
        side = imatrix_path(path)
        name = side.name
        files[side] = lambda tmp: save_imatrix(tmp, kept, {"calibration": sens.calibration})
    text = plan_text(plan, header, name, host)
    files[path] = lambda tmp: Path(tmp).write_text(text, encoding="utf-8")
    return files, len(kept)


def save_plan(path, plan: dict, sens, header: list[str], inputs=(), force: bool = False) -> int:
    """Write the plan file and, beside it (``<plan>.imatrix.safetensors``, named in the plan), the calibrated scales
    of the items whose chosen format measured better with them, both or neither (:func:`toolkit.writes.publish`),
    under the write rule (``inputs``: what the plan was made from, never overwritten); returns how many items use
    the scales."""
    from ..writes import check_file_target, publish

    check_file_target(path, "plan", inputs, force)
    check_file_target(imatrix_path(path), "imatrix", inputs, force)
    files, n = plan_files(path, plan, sens, header)
    publish(files)
    return n
