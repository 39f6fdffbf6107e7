"""Issue 29's generated tables: every argument that a ``moqe`` subcommand declares as a written target or a read
input (``toolkit.cli._arg(..., writes=KIND | reads=KIND)``) gets the same hostile cases, built from the parser
itself, so that a new command or flag that writes or reads is covered without a line written here, except its
one base command in :data:`BASE` (the test fails, naming it, until that line exists).

- WRITES: absent target (ok), the same command again over its own output (ok, no --force), a user's file
  (refused, unchanged; with --force replaced, for a plain file), a folder, a file of the source model (refused,
  --force too), an input of the same command, a symlink, an empty string, a missing parent folder, a full disk
  (refused, "nothing was replaced", no temporary file left), two targets naming one file.
- READS: a missing path, an empty string, a FIFO (never opened: no hang), a folder where a file is read, a
  file of random bytes.

These rows are ``damage.cases.Case`` rows, run and judged by the damage harness (tests/test_damage.py):
protected files byte for byte, no file opened outside the case folder, one error line, no traceback.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from . import cases as C

RX = re.escape


# ---- fixtures a base command needs, made inside the case folder -----------------------------------------------
def table(ctx: C.Ctx, model: Path, name: str = "s.json") -> Path:
    """A sensitivity table of ``model`` (made-up losses, true byte counts) with an importance file beside it,
    as ``moqe plan --sensitivity`` writes one: ``moqe plan --reuse`` plans from it in well under a second."""
    from toolkit.model import load_config
    from toolkit.quant.imatrix import save_imatrix
    from toolkit.quant.sensitivity import ExpertStats, Sensitivity

    cfg = load_config(model)
    formats = ("int8", "int4-g32", "int2-g32")
    sens = Sensitivity(str(model), "made up by tests/damage/targets.py", 256, formats)
    rng = np.random.default_rng(0)
    from toolkit.formats import get_format

    for i in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            sens.stats[(i, e)] = ExpertStats(10, 1.0)
            for p, shape in (("gate_up", [2 * cfg.expert_intermediate, cfg.hidden_size]),
                             ("down", [cfg.hidden_size, cfg.expert_intermediate])):
                k = (i, p, e)
                sens.shapes[k] = shape
                sens.loss[k] = {f: float(rng.random()) * (1 + 8 * j) for j, f in enumerate(formats)}
                sens.rtn[k] = dict(sens.loss[k])
                sens.nbytes[k] = {f: get_format(f).nbytes(tuple(shape)) for f in formats}
                if p == "down":
                    sens.calibrated[k] = {"int2-g32"}
                    sens.imatrix[k] = rng.random(shape[1]).astype(np.float32)
    d = sens.to_json()
    path = ctx.dir / name
    d["imatrix"] = path.name + ".imatrix.safetensors"
    save_imatrix(path.parent / d["imatrix"], sens.imatrix)
    path.write_text(json.dumps(d))
    return path


def plan_file(ctx: C.Ctx, model: Path, name: str = "p.plan") -> Path:
    from toolkit.model import load_config

    cfg = load_config(model)
    lines = ["# moqe plan: made by tests/damage/targets.py"]
    lines += [f"layers.{i}.moe.{p}.{e}=int4-g32" for i in range(cfg.num_layers) for p in ("gate_up", "down")
              for e in range(cfg.num_experts)]
    path = ctx.dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


# BASE[(command, flag)] -> setup(ctx) -> (argv, {flag: value}, {flag: (input path, role)}): a valid command whose
# value for ``flag`` the cases replace; the inputs are what the command reads (a target must never be one).
def _plan(ctx):
    m = ctx.tiny()
    s = table(ctx, m)
    return ["plan", "--model", str(m), "--reuse", str(s), "--budget-mb", "1"], m, {"--reuse": s}


def _export(ctx):
    m = ctx.tiny()
    return ["export", "--model", str(m), "--experts", "q8_0"], m, {}


def _quantize(ctx):
    m = ctx.tiny()
    return ["quantize", "--model", str(m), "--experts", "int4"], m, {}


def _quantize_plan(ctx):
    m = ctx.tiny()
    return ["quantize", "--model", str(m)], m, {"--plan": plan_file(ctx, m)}


def _generate(ctx):
    m = ctx.tiny()
    return ["generate", "--model", str(m), "--prompt", C.PROMPT, "--max-new-tokens", "2"], m, {}


def _perplexity(ctx):
    m = ctx.tiny()
    return ["perplexity", "--model", str(m)], m, {"--text": ctx.text()}


def _plan_calibrate(ctx):
    m = ctx.tiny()
    return ["plan", "--model", str(m), "--calib-start", "0", "--calib-tokens", "64", "--formats", "int8,int2-g64",
            "--budget-mb", "1", "--out", str(ctx.dir / "p.plan")], m, {"--calib-text": ctx.text()}


def _trace(ctx):
    m = ctx.tiny()
    return ["trace", "--model", str(m), "--window", "16"], m, {"--text": ctx.text()}


def _info(ctx):
    m = ctx.tiny()
    return ["info", "--model", str(m)], m, {}


def _serve(ctx):  # (every case refuses its input before the server would start listening)
    m = ctx.tiny()
    return ["serve", "--model", str(m), "--port", "0", "--log-level", "error"], m, {}


def _inspect(ctx):
    b = ctx.bundle()
    return ["uqff", "inspect"], b, {}


BASE = {"plan": _plan, "export": _export, "quantize": _quantize, "generate": _generate, "perplexity": _perplexity,
        "info": _info, "uqff inspect": _inspect, "trace": _trace, "serve": _serve}
def _export_plan(ctx):
    m = ctx.tiny()
    return ["export", "--model", str(m)], m, {"--plan": plan_file(ctx, m)}


def _plan_joint(ctx):
    """``moqe plan --vram --ram --trace``: a made-up table and a routing trace of the tiny model (even routing)."""
    from toolkit.model import load_config
    from toolkit.quant.trace import Trace, save

    m = ctx.tiny()
    s = table(ctx, m)
    cfg = load_config(m)
    L, E, A = cfg.num_layers, cfg.num_experts, cfg.top_k
    t = ctx.dir / "r.trace"
    pairs = np.full((L, E, E), 2, np.int64)
    pairs[:, np.arange(E), np.arange(E)] = 16 * A // E
    save(t, Trace(tuple(range(L)), np.full((L, E), 16 * A // E, np.int64), pairs, 16, A))
    return (["plan", "--model", str(m), "--reuse", str(s), "--vram", "1", "--ram", "1", "--host-gbs",
             "int8=5,int4-g32=5,int2-g32=5"], m, {"--reuse": s, "--trace": t})


def _with_ep(base_of):
    """A base command with ``--ep 2``: ``--ep-split`` is read only with it (the trace is read before Ray starts)."""
    def base(ctx):
        argv, m, inputs = base_of(ctx)
        return argv + ["--ep", "2"], m, inputs
    return base


READ_BASE = {("quantize", "--plan"): _quantize_plan, ("plan", "--calib-text"): _plan_calibrate,
             ("export", "--plan"): _export_plan, ("plan", "--trace"): _plan_joint,
             **{(cmd, "--ep-split"): _with_ep(BASE[cmd]) for cmd in ("generate", "perplexity", "info")}}
NEEDS = {"--gguf": "x.gguf", "--out": "out", "--sensitivity": "s_out.json"}


def declared() -> tuple[list, list]:
    """[(command, flag, dest, kind)] of every declared target and input, read from the CLI's parser."""
    from toolkit.cli import build_parser

    writes, reads = [], []
    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if a.choices and isinstance(a.choices, dict) and hasattr(a, "dest")]
        parsers = [(f"{name} {n}", q) for a in nested for n, q in a.choices.items()] if nested else [(name, p)]
        for cmd, q in parsers:
            d = q.get_default("_writes") or []
            writes += [(cmd, flag, dest, kind) for dest, flag, kind in d]
            reads += [(cmd, flag, dest, kind) for dest, flag, kind in (q.get_default("_reads") or [])]
    return writes, reads


def _argv(base: list, flag: str, value, others: dict) -> list:
    """``base`` with ``flag`` set to ``value`` (a positional when ``flag`` has no dashes) and the others' values."""
    out = list(base)
    for f, v in others.items():
        if f != flag:
            out += [f, str(v)] if f.startswith("-") else [str(v)]
    out += [flag, str(value)] if flag.startswith("-") else [str(value)]
    return out


def _default_targets(cmd: str, flag: str, ctx: C.Ctx) -> dict:
    """The command's other required targets (given fresh names), so one target can be varied at a time."""
    need = {"plan": ["--out"], "export": ["--gguf"], "trace": ["--out"]}.get(cmd, [])
    return {f: ctx.dir / ("other_" + NEEDS[f]) for f in need if f != flag}


def full_disk(ctx: C.Ctx, name: str = "full") -> Path:
    """A 64 KiB tmpfs inside the case folder, filled up but for a few hundred bytes."""
    d = ctx.full_disk(name, 64 * 1024)
    with open(d / "filler", "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 512):
                pass
        except OSError:
            pass
    os.truncate(d / "filler", os.path.getsize(d / "filler") - 512)
    ctx.protect(d / "filler")
    ctx.exact(d)
    return d


def user_file(ctx: C.Ctx, name: str) -> Path:
    p = ctx.dir / name
    p.write_bytes(b"the user's own file\n" + os.urandom(32))
    ctx.protect(p)
    return p


def write_rows() -> list:
    """The generated WRITES table."""
    writes, _ = declared()
    rows = []
    for cmd, flag, dest, kind in writes:
        if cmd not in BASE:
            def missing(ctx, cmd=cmd):
                raise AssertionError(f"tests/damage/targets.py: add a base command for 'moqe {cmd}' to BASE")
            rows.append(C.Case(f"{cmd}{flag}-base", "write", missing, C.VALID))
            continue
        plain = kind != "bundle"
        name = NEEDS[flag]
        what = {"plan": "plan file", "table": "sensitivity table", "gguf": "GGUF file", "bundle": "bundle",
                "trace": "routing trace"}[kind]

        def mk(variant, cmd=cmd, flag=flag, kind=kind, plain=plain, name=name):
            def setup(ctx: C.Ctx) -> C.Run:
                base, model, inputs = BASE[cmd](ctx)
                ctx.protect(model, *inputs.values())
                others = {**inputs, **_default_targets(cmd, flag, ctx)}
                force = []
                if variant == "absent":
                    target = ctx.dir / name
                elif variant == "own-again":
                    argv = _argv(base, flag, ctx.dir / name, others)
                    return C.Run(argv, then=argv)
                elif variant in ("user-file", "user-file-force"):
                    target = user_file(ctx, name)
                    if variant == "user-file-force":
                        ctx.protected.remove(target)
                        force = ["--force"]
                elif variant == "folder":
                    target = C.user_files(ctx.dir / name)
                    ctx.protect(target)
                elif variant in ("model-file", "model-file-force"):
                    target = model / "config.json" if plain else model / "sub"
                    force = ["--force"] if variant.endswith("force") else []
                elif variant == "model-folder":
                    target = model
                elif variant == "input-file":
                    target = next(iter(inputs.values()))
                elif variant == "symlink":
                    victim = user_file(ctx, "victim")
                    target = ctx.dir / name
                    target.symlink_to(victim)
                elif variant == "empty":
                    target = ""
                elif variant == "no-parent":
                    target = ctx.dir / "missing" / name
                elif variant == "full-disk":
                    target = full_disk(ctx) / name
                elif variant == "same-as-other":
                    target = next(iter(_default_targets(cmd, flag, ctx).values()))
                argv = _argv(base, flag, target, others) + (force if plain else [])
                return C.Run(argv)
            return setup

        t = RX(name)
        variants = [
            ("absent", C.VALID, None),
            ("own-again", C.VALID, None),
            ("user-file", C.BAD, rf"{t}: exists and is not an? (?:{what} written by this toolkit; refusing to replace it "
                                 rf"\(give another name, or pass --force|directory)" if plain else rf"{t}: exists and is not a directory"),
            ("folder", C.BAD, rf"{t}: is a folder; give the file name of the {what}" if plain else
             rf"{t}: exists and is not a UQFF bundle written by this toolkit"),
            ("model-file", C.BAD, rf"lies inside the source (?:model|checkpoint) \S*/model; write the {what} to a separate folder"),
            ("model-folder", C.BAD, rf"model: is the source (?:model|checkpoint) \S*/model; write the {what} to a separate folder"),
            ("symlink", C.BAD, rf"{t}: is a symbolic link"),
            ("empty", C.BAD, rf"(?:{RX(flag)}|--out) is empty"),
            ("no-parent", C.BAD, r"missing: no such folder" if plain else None),
            ("full-disk", C.BAD, rf"{t}(?:\.imatrix\.safetensors)?: writing failed \(No space left on device\); nothing was replaced" if plain else
             r"writing the bundle failed \(No space left on device\); nothing was replaced"),
        ]
        if plain:
            variants += [("user-file-force", C.VALID, None), ("model-file-force", C.BAD, r"lies inside the source model")]
        if cmd == "plan":
            variants.append(("input-file", C.BAD, r"s\.json: is the --reuse file \S*s\.json; write the \w[\w ]* elsewhere"))
        if _default_targets(cmd, flag, C.Ctx(Path("/nonexistent"), None)):
            variants.append(("same-as-other", C.BAD, r"name the same file"))
        for variant, expect, message in variants:
            if expect == C.BAD and message is None:
                expect = C.EITHER if variant != "no-parent" else C.VALID  # a bundle's missing parent is created
            rows.append(C.Case(f"{cmd}{flag}-{variant}", "write", mk(variant), expect, message))
    return rows


def read_rows() -> list:
    """The generated READS table."""
    _, reads = declared()
    rows = []
    for cmd, flag, dest, kind in reads:
        base_of = READ_BASE.get((cmd, flag)) or BASE.get(cmd)
        if base_of is None:
            def missing(ctx, cmd=cmd):
                raise AssertionError(f"tests/damage/targets.py: add a base command for 'moqe {cmd}' to BASE")
            rows.append(C.Case(f"{cmd}{flag}-base", "read", missing, C.VALID))
            continue

        def mk(variant, cmd=cmd, flag=flag, kind=kind, base_of=base_of):
            def setup(ctx: C.Ctx) -> C.Run:
                base, model, inputs = base_of(ctx)
                ctx.protect(model, *inputs.values())
                others = {**inputs, **_default_targets(cmd, "", ctx)}
                if flag in ("--model", "bundle"):  # the model is in the base command: take it out
                    base = [a for a in base if a not in (str(model), "--model")]
                if variant == "missing":
                    value = ctx.dir / "nothing-here"
                elif variant == "empty":
                    value = ""
                elif variant == "fifo":
                    value = ctx.dir / "a-fifo"
                    os.mkfifo(value)
                    ctx.fifos = getattr(ctx, "fifos", []) + [value]
                elif variant == "folder":
                    value = C.user_files(ctx.dir / "a-folder")
                elif variant == "random-bytes":
                    value = ctx.dir / "random.bin"
                    value.write_bytes(np.random.default_rng(1).bytes(4096))
                return C.Run(_argv(base, flag, value, others))
            return setup

        variants = [("missing", r"nothing-here"), ("empty", r"empty|no such"), ("fifo", r"a-fifo: (?:is a FIFO|is a file)"),
                    ("random-bytes", r"random\.bin")]
        if kind != "model":
            variants.append(("folder", r"a-folder"))
        for variant, message in variants:
            rows.append(C.Case(f"{cmd}{flag}-{variant}", "read", mk(variant), C.BAD, message))
    return rows


WRITE = write_rows()
READ = read_rows()


# ---- issue 29's findings, one row each (the generated tables above cover their classes too) --------------------
def _plan_with(lines_edit=None, header=None):
    """``moqe quantize --model M --plan plans/P`` with the plan's lines edited (the plan in a folder of its own,
    so that the case's ``outside/`` folder is outside it)."""
    def setup(ctx: C.Ctx) -> C.Run:
        m = ctx.tiny()
        p = plan_file(ctx, m, "plans/p.plan")
        lines = p.read_text().splitlines()
        if lines_edit:
            lines = lines_edit(ctx, lines)
        p.write_text("\n".join(lines) + "\n")
        ctx.protect(m, p)
        return C.Run(["quantize", "--model", str(m), "--plan", str(p)])
    return setup


def _imatrix_line(where: str):
    """A plan whose ``#! imatrix=`` line points at an importance file outside the plan's folder."""
    def edit(ctx: C.Ctx, lines: list) -> list:
        from toolkit.quant.imatrix import save_imatrix

        src = ctx.dir / "made.safetensors"
        save_imatrix(src, {(0, "down", 0): np.ones(64, np.float32)})
        out = ctx.plant_outside(src, "scales.safetensors")
        src.unlink()
        name = {"absolute": str(out), "dotdot": "../outside/scales.safetensors", "symlink": "link.safetensors"}[where]
        if where == "symlink":
            (ctx.dir / "plans" / name).symlink_to(out)
        return lines[:1] + [f"#! imatrix={name}"] + lines[1:]
    return edit


def _rename_layer(old: str, new: str):
    def edit(ctx: C.Ctx, lines: list) -> list:
        return [ln.replace(old, new, 1) if ln.startswith(old) else ln for ln in lines]
    return edit


def _reuse(edit, budget=("--budget-mb", "0.01")):
    """``moqe plan --reuse S`` with the table edited (``edit(table dict)``)."""
    def setup(ctx: C.Ctx) -> C.Run:
        m = ctx.tiny()
        s = table(ctx, m)
        d = json.loads(s.read_text())
        edit(ctx, d)
        s.write_text(d if isinstance(d, str) else json.dumps(d, allow_nan=True))
        ctx.protect(m, s)
        return C.Run(["plan", "--model", str(m), "--reuse", str(s), *budget, "--out", str(ctx.dir / "p.plan")])
    return setup


def _set_item(field, fmt, value, n=0):
    def edit(ctx, d):
        d["items"][n][field][fmt] = value
    return edit


def _raw_table(text_edit):
    """The table's JSON text edited (numbers JSON can spell but Python's float cannot hold)."""
    def setup(ctx: C.Ctx) -> C.Run:
        m = ctx.tiny()
        s = table(ctx, m)
        s.write_text(text_edit(s.read_text()))
        ctx.protect(m, s)
        return C.Run(["plan", "--model", str(m), "--reuse", str(s), "--budget-mb", "0.01", "--out", str(ctx.dir / "p.plan")])
    return setup


def _first_loss(text: str, value: str) -> str:
    return re.sub(r'("loss": \{"int8": )[^,}]+', lambda mm: mm.group(1) + value, text, count=1)


def _export_into_model(name):
    def setup(ctx: C.Ctx) -> C.Run:
        m = ctx.tiny()
        ctx.protect(m)
        return C.Run(["export", "--model", str(m), "--experts", "q8_0", "--gguf", str(m / name)])
    return setup


def _plan_onto_model(flag, name):
    def setup(ctx: C.Ctx) -> C.Run:
        base, m, inputs = _plan(ctx)
        ctx.protect(m, *inputs.values())
        out = ["--out", str(ctx.dir / "p.plan")] if flag != "--out" else []
        return C.Run(base + out + [flag, str(m / name)])
    return setup


def _plan_sidecar_user_file(ctx: C.Ctx) -> C.Run:
    base, m, inputs = _plan(ctx)
    side = user_file(ctx, "p.plan.imatrix.safetensors")
    ctx.protect(m, *inputs.values(), side)
    return C.Run(base + ["--out", str(ctx.dir / "p.plan")])


def _forged_report(listing):
    """A bundle of ours whose report also lists a user's file or folder: quantize --out onto it must keep them."""
    def setup(ctx: C.Ctx) -> C.Run:
        m, b = ctx.tiny(), ctx.bundle()
        r = C.read_report(b)
        if listing == "file-wrong-crc":
            (b / "notes.txt").write_text("my notes\n")
            r["files"]["notes.txt"] = {"bytes": 9, "crc32": 1}
        elif listing == "folder":
            C.user_files(b / "data")
            r["files"]["data"] = {"bytes": 4096, "crc32": 0}
        elif listing == "symlink":
            victim = user_file(ctx, "victim.txt")
            (b / "link.txt").symlink_to(victim)
            import zlib

            r["files"]["link.txt"] = {"bytes": victim.stat().st_size, "crc32": zlib.crc32(victim.read_bytes())}
        elif listing == "path":
            victim = user_file(ctx, "victim.txt")
            r["files"]["../victim.txt"] = {"bytes": victim.stat().st_size, "crc32": 0}
        C.write_json(b / "uqff_report.json", r)
        ctx.protect(m, b)
        return C.Run(["quantize", "--model", str(m), "--experts", "int4", "--out", str(b)])
    return setup


def _mistralrs_schema(link: str):
    """A bundle whose report has mistral.rs's schema, with a shard or the residual file symlinked out of it."""
    def setup(ctx: C.Ctx) -> C.Run:
        b = ctx.bundle()
        r = C.read_report(b)
        C.write_json(b / "uqff_report.json", {"schema": 1, "generated_by": "mistralrs", "uqff_version": "0.1.2",
                                              "outputs": [{"quant": "q4k", "shards": [s["file"] for s in r["shards"]]}]})
        ctx.move_outside(b / link)
        return C.Run(["generate", "--model", str(b), "--prompt", C.PROMPT, "--max-new-tokens", "2"])
    return setup


def _quantize_out_empty(ctx: C.Ctx) -> C.Run:
    m = ctx.tiny()
    ctx.protect(m)
    return C.Run(["quantize", "--model", str(m), "--experts", "int4", "--out", ""])


def _plan_flag(*argv):
    def setup(ctx: C.Ctx) -> C.Run:
        base, m, inputs = _plan(ctx)
        base = [a for a in base if a not in ("--budget-mb", "1")]
        return C.Run(base + list(argv) + ["--out", str(ctx.dir / "p.plan")])
    return setup


NUM = r"must be a finite (?:decimal )?number"
FINDINGS = [C.Case(i, "finding", s, e, m) for i, s, e, m in [
    # data loss
    ("export-gguf-onto-model-safetensors", _export_into_model("model.safetensors"), C.BAD,
     r"model/model\.safetensors: lies inside the source model \S*/model; write the GGUF file to a separate folder"),
    ("plan-out-onto-model-config", _plan_onto_model("--out", "config.json"), C.BAD,
     r"model/config\.json: lies inside the source model"),
    ("plan-sensitivity-onto-model-tokenizer", _plan_onto_model("--sensitivity", "tokenizer.json"), C.BAD,
     r"model/tokenizer\.json: lies inside the source model"),
    ("plan-sidecar-onto-user-file", _plan_sidecar_user_file, C.BAD,
     r"p\.plan\.imatrix\.safetensors: exists and is not an importance file written by this toolkit; refusing"),
    ("quantize-out-report-lists-user-file", _forged_report("file-wrong-crc"), C.BAD,
     r"bundle: exists and is not a UQFF bundle written by this toolkit"),
    ("quantize-out-report-lists-user-folder", _forged_report("folder"), C.BAD,
     r"bundle: exists and is not a UQFF bundle written by this toolkit"),
    ("quantize-out-report-lists-symlink", _forged_report("symlink"), C.BAD,
     r"bundle: exists and is not a UQFF bundle written by this toolkit"),
    ("quantize-out-report-lists-parent-path", _forged_report("path"), C.BAD, r"bundle: "),
    # reads outside
    ("plan-imatrix-absolute", _plan_with(_imatrix_line("absolute")), C.BAD, r"points outside the folder"),
    ("plan-imatrix-dotdot", _plan_with(_imatrix_line("dotdot")), C.BAD, r"points outside the folder"),
    ("plan-imatrix-symlink-out", _plan_with(_imatrix_line("symlink")), C.BAD,
     r"link\.safetensors: resolves to \S+, outside \S+ \(a symlink leaving the folder"),
    ("reuse-imatrix-dotdot", _reuse(lambda ctx, d: d.update(imatrix="../outside/s.json.imatrix.safetensors")), C.BAD,
     r"'imatrix': file name '\.\./outside/s\.json\.imatrix\.safetensors' points outside the folder"),
    ("reuse-imatrix-absolute", _reuse(lambda ctx, d: d.update(imatrix=str(ctx.plant_outside(b"x", "abs.safetensors")))),
     C.BAD, r"points outside the folder"),
    ("mistralrs-report-shard-symlinked-out", _mistralrs_schema("model-0.uqff"), C.BAD,
     r"model-0\.uqff: resolves to \S+, outside \S+bundle \(a symlink leaving the folder"),
    ("mistralrs-report-residual-symlinked-out", _mistralrs_schema("residual.safetensors"), C.BAD,
     r"residual\.safetensors: resolves to \S+, outside \S+bundle \(a symlink leaving the folder"),
    # bad input accepted
    ("reuse-bytes-zero", _reuse(_set_item("bytes", "int2-g32", 0)), C.BAD,
     r"items\[0\]\.bytes\['int2-g32'\] must be a whole number in \[1, "),
    ("reuse-bytes-negative", _reuse(_set_item("bytes", "int2-g32", -5000)), C.BAD,
     r"items\[0\]\.bytes\['int2-g32'\] must be a whole number in \[1, "),
    ("reuse-bytes-understated", _reuse(_set_item("bytes", "int8", 10)), C.BAD,
     r"items\[0\]: bytes\['int8'\] is 10, but int8 at shape \[64, 64\] takes 4,352"),
    ("reuse-loss-minus-inf-string", _reuse(_set_item("loss", "int8", "-inf")), C.BAD,
     rf"items\[0\]\.loss\['int8'\] {NUM}, got '-inf'"),
    ("reuse-loss-negative", _reuse(_set_item("loss", "int8", -1.0)), C.BAD, r"items\[0\]\.loss\['int8'\] must lie in \[0, "),
    ("reuse-item-for-missing-layer", _reuse(lambda ctx, d: d["items"].append({**d["items"][0], "name": "layers.7.moe.down.0"})),
     C.BAD, r"item layers\.7\.moe\.down\.0 is not a routed expert projection of the model"),
    ("reuse-item-missing", _reuse(lambda ctx, d: d["items"].pop()), C.BAD, r"no item for layers\.1\.moe\.gate_up\.3 \(1 of the model's 16 expert projections missing\)"),
    ("reuse-item-twice", _reuse(lambda ctx, d: d["items"].append(d["items"][0])), C.BAD, r"is listed twice"),
    ("reuse-shape-wrong", _reuse(_set_item("shape", 0, 32)), C.BAD, r"items\[0\]: bytes\['int8'\] is 4,352, but int8 at shape \[32, 64\]"),
    ("plan-layer-00", _plan_with(_rename_layer("layers.0.", "layers.00.")), C.BAD,
     r"the layer number must be written without leading zeros, got '00'"),
    ("plan-layer-arabic-digit", _plan_with(_rename_layer("layers.1.", "layers.\u0661.")), C.BAD,
     r"the layer number must be a whole number of at most 19 ASCII digits"),
    ("plan-expert-fullwidth-digit", _plan_with(_rename_layer("layers.0.moe.down.1", "layers.0.moe.down.\uff11")), C.BAD,
     r"the expert number must be a whole number of at most 19 ASCII digits"),
    ("quantize-out-empty", _quantize_out_empty, C.BAD, r"--out is empty; give the folder to write"),
    # tracebacks
    ("plan-bits-nan", _plan_flag("--bits-per-weight", "nan"), C.BAD, r"argument --bits-per-weight: the value must be a finite"),
    ("plan-bits-inf", _plan_flag("--bits-per-weight", "inf"), C.BAD, r"argument --bits-per-weight: the value must be a finite"),
    ("plan-bits-1e308", _plan_flag("--bits-per-weight", "1e308"), C.BAD, r"argument --bits-per-weight: the value must lie in \(0, 64\]"),
    ("plan-bits-zero", _plan_flag("--bits-per-weight", "0"), C.BAD, r"argument --bits-per-weight: the value must lie in \(0, 64\]"),
    ("plan-budget-nan", _plan_flag("--budget-mb", "nan"), C.BAD, r"argument --budget-mb: the value must be a finite"),
    ("plan-budget-minus-1", _plan_flag("--budget-mb", "-1"), C.BAD, r"argument --budget-mb: the value must lie in \(0, "),
    ("reuse-number-past-float-range", _raw_table(lambda t: _first_loss(t, "1e400")), C.BAD,
     rf"items\[0\]\.loss\['int8'\] {NUM}, got inf"),
    ("reuse-int-past-float-range", _raw_table(lambda t: _first_loss(t, "9" * 400)), C.BAD,
     rf"items\[0\]\.loss\['int8'\] {NUM}, got an integer of 400 digits"),
    ("reuse-nan-string", _reuse(_set_item("loss", "int8", "nan")), C.BAD, rf"items\[0\]\.loss\['int8'\] {NUM}, got 'nan'"),
    ("reuse-empty-formats", _reuse(lambda ctx, d: d.update(formats=[])), C.BAD, r"'formats' must be a non-empty list"),
    ("reuse-unknown-format", _reuse(lambda ctx, d: d.update(formats=["int9"])), C.BAD, r"unknown format 'int9'"),
    ("reuse-malformed-key", _reuse(lambda ctx, d: d["items"][0].update(name="layers.x.moe.down.0")), C.BAD,
     r"items\[0\]\.name: 'layers\.x\.moe\.down\.0': the layer number must be a whole number"),
    ("reuse-factor-key-malformed", _reuse(lambda ctx, d: d.update(layer_factors={"layers": 1.0})), C.BAD,
     r"layer factor 'layers': 'layers\.0' is not an expert projection"),
    ("reuse-not-an-object", _reuse(lambda ctx, d: d.update(items=[1, 2])), C.BAD, r"items\[0\] has no 'name'"),
    ("plan-layer-5000-digits", _plan_with(_rename_layer("layers.0.moe.down.0", "layers." + "9" * 5000 + ".moe.down.0")),
     C.BAD, r"the layer number must be a whole number of at most 19 ASCII digits, got '9999"),
    ("plan-layer-out-of-range", _plan_with(_rename_layer("layers.1.moe.down.0", "layers.123456789.moe.down.0")), C.BAD,
     r"the model has no MoE layer 123456789"),
]]
