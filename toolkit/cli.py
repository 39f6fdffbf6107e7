"""The ``moqe`` command line. Each subcommand is one small function; heavy imports happen inside it."""
from __future__ import annotations

import argparse
import math
import sys

from .errors import ToolkitError


def cmd_formats(args) -> int:
    """List the format registry: bits, group sizes, stored bits per weight, on-disk tag."""
    from .bench.timing import print_table
    from .formats import FORMATS

    rows = []
    for f in FORMATS.values():
        groups = ",".join(map(str, f.group_sizes)) if f.group_sizes else (str(f.group_size) if f.group_size else "per row")
        rows.append({"format": f.name, "bits": f.bits, "group sizes": groups, "default": f.spec,
                     "bits/weight (K=4096)": round(f.bits_per_weight((4096, 4096)), 4), "description": f.doc})
    print_table(rows, "quantization formats")
    return 0


DEFAULT_MODEL = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "model")


def _policy(args):
    """The policy of the flags, fitted to the model (a group size picked for ``--experts int3``, said once)."""
    from .model import load_config
    from .quant import parse_policy
    from .uqff import is_bundle

    if getattr(args, "plan", None):
        from .quant.plan import plan_policy

        if args.experts or args.override or args.policy not in (None, "moqe"):
            raise ToolkitError("--plan names every expert's format; drop --experts, --override and --policy")
        if is_bundle(args.model):
            raise ToolkitError(f"{args.model}: is a UQFF bundle; a plan quantizes an original checkpoint")
        return plan_policy(args.plan, load_config(args.model, args.allow_outside))
    preset = args.policy or ("moqe" if args.experts else "none")
    policy = parse_policy(preset, args.experts, args.override or ())
    if policy.auto_group and not is_bundle(args.model):
        policy, note = policy.fit(load_config(args.model, args.allow_outside))
        if note:
            print(f"moqe {args.command}: {note}", file=sys.stderr)
    return policy


def _compiling(args):
    """The one line printed when Numba starts compiling (a cold cache: the first run on a machine)."""
    what = [args.experts or "f32"] + ([f"{args.kv_cache} cache"] if getattr(args, "kv_cache", None) else [])
    return lambda: print(f"[compiling kernels for {' / '.join(what)}: first run only, cached for later runs]",
                         file=sys.stderr, flush=True)


def _check_model_arg(args) -> None:
    if not str(args.model).strip():
        raise ToolkitError("--model is empty; give a model folder (or leave it out for the bundled model)")


def _placement(args):
    """The placement flags (``--cpu-moe``, ``--n-cpu-moe N``, ``--placement FILE``) as a PlacementSpec, or None."""
    from .model.placement import PlacementSpec

    spec = PlacementSpec(getattr(args, "cpu_moe", False), getattr(args, "n_cpu_moe", None), getattr(args, "placement", None),
                         getattr(args, "plan", None))
    return spec if spec.given else None


def _ep(args):
    """``--ep N [--ray-address ADDR] [--ep-split TRACE] [--ep-transport T]`` as an EPSpec, or None (one process)."""
    if getattr(args, "ep", None) is None:
        if getattr(args, "ep_split", None) is not None:
            raise ToolkitError("--ep-split balances the expert ranks of --ep N: give --ep too")
        return None
    from .dist import EPSpec

    return EPSpec(args.ep, address=getattr(args, "ray_address", None), split=args.ep_split,
                  cpus=getattr(args, "ep_cpus", None) or 1, transport=getattr(args, "ep_transport", None) or "graph")


def _load(args, report=None, policy=None):
    from .load import load_model

    _check_model_arg(args)
    model, tok = load_model(args.model, backend=args.backend, policy=policy or _policy(args), progress=True,
                            report=report, kv_cache=getattr(args, "kv_cache", None), allow_outside=args.allow_outside,
                            activations=getattr(args, "activations", None), placement=_placement(args), ep=_ep(args))
    model.kv_rotate = getattr(args, "kv_rotate", "auto")
    return model, tok


def _timing(n: int, seconds: float) -> str:
    """'5 tokens in 12.3 ms (407 tok/s)': a time always, a rate with three significant digits."""
    t = f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
    rate = f" ({n / seconds:.3g} tok/s)" if seconds > 0 and n else ""
    return f"{n} token{'s' if n != 1 else ''} in {t}{rate}"


def cmd_quantize(args) -> int:
    """Quantize a checkpoint with a policy (streaming) and print which weight got which format."""
    import time

    from .bench.timing import print_table
    from .quant import QuantReport
    from .warmup import compile_watch

    policy = _policy(args)
    report = QuantReport(policy.label)
    t0 = time.perf_counter()
    if args.out is not None:
        from .uqff import load_bundle, save_bundle

        shard_bytes = _size(args.shard_size)
        with compile_watch(on_first=_compiling(args)):
            host = None
            if args.plan:  # a joint plan's places go into the bundle (the default of a device load)
                from .files import read_text
                from .model import load_config
                from .quant.plan import plan_places

                host = plan_places(read_text(args.plan, "plan file"), load_config(args.model, args.allow_outside), args.plan)
            save_bundle(args.model, args.out, policy, shard_bytes=shard_bytes, backend=args.backend, host=host,
                        allow_outside=args.allow_outside)
            print(f"wrote UQFF bundle {args.out} in {time.perf_counter() - t0:.1f} s")
            model, _ = load_bundle(args.out, args.backend, report=report)
    else:
        with compile_watch(on_first=_compiling(args)):
            model, _ = _load(args, report, policy)
    dt = time.perf_counter() - t0
    if args.verbose:
        print_table(report.rows, "weights")
    print_table(report.summary(), f"policy {report.policy}: quantized in {dt:.1f} s")
    wb = model.weight_bytes()
    print(f"\nweight bytes held: experts {wb['experts']:,}, attention {wb['attention']:,}, other {wb['other']:,}")
    return 0


def cmd_export(args) -> int:
    """Write a GGUF file (Mixtral, in llama.cpp's names) with the policy's GGML types."""
    import time

    from .gguf.export import export_gguf
    from .warmup import compile_watch

    _check_model_arg(args)
    t0 = time.perf_counter()
    with compile_watch(on_first=_compiling(args)):
        info = export_gguf(args.model, args.gguf, _policy(args), allow_outside=args.allow_outside, force=args.force,
                           inputs=_inputs(args))
    types = ", ".join(f"{n} {k}" for k, n in sorted(info["types"].items()))
    print(f"wrote {args.gguf}: {info['tensors']} tensors ({types}), {info['bytes']:,} bytes in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def _size(text: str) -> int:
    """'10GiB', '512MiB', '1000000' -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", str(text), re.I)
    if not m:
        raise ToolkitError(f"bad size {text!r} (e.g. 10GiB, 512MiB, 1000000)")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def cmd_uqff_inspect(args) -> int:
    """Version, layers by format and bytes of a UQFF bundle, read from its headers (no weights loaded)."""
    from .bench.timing import print_table
    from .uqff import inspect_bundle

    info = inspect_bundle(args.bundle, getattr(args, "allow_outside", False))
    src = info["source"] if isinstance(info["source"], dict) else {}
    print(f"{info['directory']}: UQFF {info['version']}, policy {info['policy']}, {len(info['shards'])} shard(s), "
          f"{info['file_bytes']:,} bytes on disk; source {src.get('path', '?')} (config sha256 {str(src.get('config_sha256', '?'))[:12]})")
    print_table(info["formats"], "quantized layers by format")
    print(f"residual: {info['residual']['tensors']} full-precision tensors, {info['residual']['bytes']:,} bytes")
    return 0


def cmd_generate(args) -> int:
    """Generate from a prompt, printing tokens as they are produced. Printed times leave compilation out, and the
    decode time leaves out detokenizing and printing (the rate is the model's, as ``bench runtime`` measures it)."""
    import time

    from .model import SamplingParams, generate_tokens
    from .warmup import compile_watch

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    params.validate()  # before the model is loaded
    with compile_watch(on_first=_compiling(args)) as cw:
        model, tok = _load(args)
        model.cuda_graphs = args.cuda_graphs
        model.compiled_decode = args.compiled_decode
        prompt_ids = tok.encode_for(args.prompt, model.cfg.vocab_size, "the prompt")
        helper = ("nothing", None)
        if args.backend == "numba" and args.compiled_decode == "auto" and cw.count:  # a cold cache: the other
            from .model.coldstart import help_compile                                   # core compiles too

            helper = help_compile(model, len(prompt_ids))
        if args.backend == "numba":
            from .model.generate import prepare

            prepare(model)  # kernels loaded from the cache (or compiled) here, not inside the timed decode
        params.stop_token_ids = tuple(model.cfg.eos_token_ids) if not args.ignore_eos else ()
        print(args.prompt, end="", flush=True)
        out: list[int] = []
        shown = ""
        c0, t0 = cw.seconds, time.perf_counter()
        t_first = c_first = None
        shown_s = 0.0  # time spent turning tokens into text and printing them: the terminal's, not the model's
        bus = model.rt.device.counters if model.rt.on_device else None
        for ev in generate_tokens(model, [prompt_ids], params):
            if t_first is None:
                t_first, c_first = time.perf_counter(), cw.seconds
                bus0 = bus.snapshot() if bus is not None else None
            if ev.reason == "stop":
                break
            s0 = time.perf_counter()
            out.append(ev.token)
            text = tok.decode(out)
            print(text[len(shown):], end="", flush=True)
            shown = text
            shown_s += time.perf_counter() - s0
        t1, c1 = time.perf_counter(), cw.seconds
    print()
    if t_first is not None:
        prefill = (t_first - t0) - (c_first - c0)
        decode = (t1 - t_first) - (c1 - c_first) - shown_s
        note = f"; {cw.seconds:.1f} s compiling kernels left out" if cw.count else ""
        print(f"[prefill {_timing(len(prompt_ids), prefill)}, decode {_timing(max(0, len(out) - 1), decode)}, "
              f"backend {args.backend}{note}]", file=sys.stderr)
        if model.rt.places is not None:
            print(_placement_line(model, bus.since(bus0), len(out) - 1), file=sys.stderr)
    if args.verbose:
        print(f"[decode path: {_decode_path(model)}; {_expert_activations(model)}]", file=sys.stderr)
    if args.compiled_decode == "auto":
        _build_later(model, helper)
    return 0


def _placement_line(model, moved, steps: int) -> str:
    """'[placement --cpu-moe: routed experts 0.0 MB on the device, 7.1 MB on the host; bus per decode step, measured:
    in 4,117 B, out 4,164 B]'."""
    wb = model.weight_bytes()
    host, dev = wb["host experts"], wb["experts"] - wb["host experts"]
    per = (f"bus per decode step, measured: in {moved.bytes_in / steps:,.0f} B, out {moved.bytes_out / steps:,.0f} B"
           if steps > 0 else "no decode step ran")
    return (f"[placement {model.rt.places.label}: routed experts {dev / 1e6:.1f} MB on the device, {host / 1e6:.1f} MB "
            f"on the host; {per}]")


def _build_later(model, helper) -> None:
    """``--compiled-decode auto``: the compiled decode steps this run found missing are compiled in a detached
    background process for the next runs (``toolkit/cpu/_detached.py``), unless the cold start's helper
    (``toolkit/model/coldstart.py``, ``helper`` = its (what happened, pid)) is on it; said in one line."""
    from .cpu._detached import compile_detached

    builds = model.missing_builds()
    if not builds:
        return
    how, pid = helper if helper[0] == "started" else compile_detached(builds)
    head = ("[this run decoded on the staged ops: the compiled decode step was not in the kernel cache yet "
            "(compiling it first would cost more than it saves in one run); ")
    tail = {"started": f"compiling it now in the background for later runs (pid {pid}, about 5-10 s of one core)]",
            "busy": "another run is compiling a decode step in the background; run again after it]",
            "unsupported": "compile it for later runs with --compiled-decode on, or moqe warmup]"}[how]
    print(head + tail, file=sys.stderr)


def _expert_activations(model) -> str:
    """Which activations the quantized experts' GEMMs took (numba: int8 where the format has an integer form)."""
    from .cpu.moe_gemm import int8_applies
    from .formats import QTensor

    if model.rt.name != "numba":
        return f"expert activations f32 (backend {model.rt.name})"
    ws = [w for layer in model.layers for w in (getattr(layer.ffn, "expert_weights", None) or ()) if isinstance(w, QTensor)]
    if not ws:
        return "expert activations f32 (no quantized experts)"
    n = sum(int8_applies(w) for w in ws)
    kinds = "int8 (integer kernels)" if n == len(ws) else "f32" if n == 0 else f"int8 for {n} of {len(ws)} expert weights, f32 for the rest"
    return f"expert activations {kinds} (--activations {model.rt.activations})"


def _decode_path(model) -> str:
    """Which path ran the one-token steps: the compiled decode step, the staged ops, or some of each (and why)."""
    paths = getattr(model, "decode_paths", {})
    c, st = paths.get("compiled", 0), paths.get("staged", 0)
    if c + st == 0:
        return "no one-token step ran"
    if st == 0:
        return f"the compiled decode step ({c} layer steps)"
    why = ("--compiled-decode off" if model.compiled_decode == "off" else
           f"backend {model.rt.name}" if model.rt.name != "numba" else
           "a layer the compiled step does not cover, a build not in the cache (--compiled-decode auto or cached), or a "
           "layer big enough for the threaded kernels")
    return (f"the staged ops ({st} layer steps: {why})" if c == 0 else
            f"mixed: {c} layer steps compiled, {st} staged ({why})")


def cmd_serve(args) -> int:
    """Serve the model over HTTP until Ctrl-C (docs/serving.md); ``toolkit/serve`` does the work."""
    from pathlib import Path

    from .serve import Server
    from .serve.chat import load_chat_template

    model, tok = _load(args)
    template = load_chat_template(args.model)
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name
    server = Server(model, tok, name, template, host=args.host, port=args.port, log_level=args.log_level,
                    slots=args.slots, context=args.context, max_queue=args.max_queue,
                    prefill_chunk=args.prefill_chunk, prefill_tokens=args.prefill_tokens,
                    expert_stats=not args.no_expert_stats)
    e = server.engine
    kv = e.cache.nbytes / 1e6
    print(f"[moqe serve: '{name}' on backend {args.backend}, {e.slots} slots x {e.context} tokens (KV cache "
          f"{kv:.1f} MB), chat template: {'yes' if template else 'none (chat requests refused)'}; "
          f"http://{args.host}:{args.port}/v1]", file=sys.stderr, flush=True)
    server.run()
    return 0


def cmd_warmup(args) -> int:
    """Compile (or load from the cache) every kernel of the given expert formats and KV cache types."""
    import os
    import time

    from .warmup import FAMILIES_ALL, KV_ALL, POLICIES, warm

    formats = tuple(f for f in args.experts.split(",") if f) if args.experts else FAMILIES_ALL
    kv = tuple(k for k in args.kv_cache.split(",") if k) if args.kv_cache else KV_ALL
    from .formats import get_format
    from .model.kv_cache import parse_kv_cache

    for f in formats:
        get_format(f)
    for k in kv:
        parse_kv_cache(k)
    t0 = time.perf_counter()
    if args.jobs < 0:
        raise ToolkitError(f"--jobs must be >= 0, got {args.jobs}")
    jobs = args.jobs or (os.cpu_count() or 1)
    from .cpu.moe_gemm import DEFAULT_ACTIVATIONS, parse_activations

    try:
        acts = parse_activations(args.warm_activations or DEFAULT_ACTIVATIONS)
    except ValueError as e:
        raise ToolkitError(str(e)) from None
    report = warm(formats, kv, policies=tuple(args.policy or POLICIES), log=lambda line: print(line, flush=True), jobs=jobs,
                  activations=acts)
    print(f"warm-up done in {time.perf_counter() - t0:.1f} s: {report.compiled} kernel(s) compiled"
          f"{'' if report.compiled else ' (all were cached)'}")
    return 0


def _text_ids(args, tok, model, text: str) -> list:
    """``--text``'s token ids for ``model``, cut to ``--max-tokens`` (0: all)."""
    ids = tok.encode_for(text, model.cfg.vocab_size, args.text)
    return ids[: args.max_tokens] if args.max_tokens else ids


def cmd_perplexity(args) -> int:
    """Held-out perplexity over a text file with a sliding window (with ``--kld``: the KL divergence from full
    precision and the router's fidelity, per MoE layer)."""
    import numpy as np
    from tqdm import tqdm

    from .files import read_text
    from .model import perplexity
    from .warmup import compile_watch

    for flag, v in (("--window", args.window), ("--stride", args.stride), ("--max-tokens", args.max_tokens)):
        if v < 0:
            raise ToolkitError(f"{flag} must be >= 0, got {v}")
    if args.window == 1:
        raise ToolkitError("--window must be at least 2 tokens")
    text = read_text(args.text, "text file")
    with compile_watch(on_first=_compiling(args)):
        model, tok = _load(args)
        ids = _text_ids(args, tok, model, text)
        if len(ids) < 2:
            raise ToolkitError(f"{args.text}: {len(ids)} token(s); perplexity needs at least two")
        ctx = model.cfg.max_position_embeddings
        if args.window > ctx:
            raise ToolkitError(f"--window {args.window} exceeds the model's context of {ctx} tokens "
                               f"(max_position_embeddings)")
        window = args.window or min(256, ctx)
        stride = args.stride or window // 2
        n_windows = max(1, -(-max(1, len(ids) - window) // stride) + 1)
        reference = None
        if args.kld:  # the same checkpoint in full precision (no quantization, f32 KV cache), same backend
            from .load import load_model
            from .quant import parse_policy

            reference, _ = load_model(args.model, backend=args.backend, policy=parse_policy("none"),
                                      allow_outside=args.allow_outside, ep=_ep(args))  # with --ep: on ranks too
        import contextlib

        from .quant.trace import Recorder, fidelity

        with contextlib.ExitStack() as routes:  # with --kld, both models' routing of the same tokens
            rec = [routes.enter_context(Recorder(m, keep_ids=True)) for m in (reference, model)] if args.kld else []
            with tqdm(total=n_windows, desc="perplexity" + (" + KLD" if args.kld else ""), unit="window") as bar:
                r = perplexity(model, ids, window, stride, progress=bar, reference=reference)
    print(f"perplexity {r['perplexity']:.3f} over {r['tokens']} tokens of {args.text} "
          f"(window {r['window']}, stride {r['stride']}, backend {args.backend})")
    if args.kld:
        print(f"against full precision (perplexity {r['ref_perplexity']:.3f}): mean KLD {r['kld_mean']:.6f}, "
              f"99th percentile {r['kld_p99']:.6f}, max {r['kld_max']:.6f}, top-1 agreement {100 * r['top1_agreement']:.2f} %")
        from .bench.timing import print_table

        rows = fidelity(rec[0].trace(), rec[1].trace())
        print_table(rows, "router fidelity against full precision, per MoE layer: the share of each token's experts both "
                          "chose (top-k overlap) and of tokens whose expert set changed (flip rate)")
        print(f"router: mean top-k overlap {100 * np.mean([x['top-k overlap'] for x in rows]):.2f} %, mean flip rate "
              f"{100 * np.mean([x['flip rate'] for x in rows]):.2f} %")
    return 0


def cmd_plan(args) -> int:
    """Measure each expert projection's sensitivity on calibration text, then pick one format per expert
    projection under a byte budget (multiple-choice knapsack) and write the plan file."""
    from tqdm import tqdm

    from .bench.timing import print_table
    from .model import load_config
    from .quant.plan import items_from, rtn_loss, solve, uniform
    from .quant.sensitivity import CANDIDATES, calibrate
    from .warmup import compile_watch
    from pathlib import Path

    _check_model_arg(args)
    joint = any(v is not None for v in (args.vram, args.ram, args.trace, args.budget_kld, args.target))
    if joint:
        from .quant.joint_cli import check_joint_args

        trace = check_joint_args(args)  # the budgets and the trace: before any measuring
    elif (args.budget_mb is None) == (args.bits_per_weight is None):
        raise ToolkitError("give one of --budget-mb N or --bits-per-weight B (or --vram GB --ram GB --trace FILE: "
                           "formats and places planned together)")
    cfg = load_config(args.model, args.allow_outside)
    if joint:
        from .quant.joint_cli import check_trace

        check_trace(trace, cfg, args.trace)  # the trace fits the model, before any measuring
    formats = tuple(f.strip() for f in args.formats.split(",")) if args.formats else CANDIDATES
    n_items = sum(cfg.moe_layers) * cfg.num_experts
    if args.reuse:  # a sensitivity table measured before (by --sensitivity): only the knapsack runs
        from .files import read_json
        from .quant.plan import importance_beside
        from .quant.sensitivity import check_table, from_json

        table = read_json(Path(args.reuse))
        sens = from_json(table, args.reuse)
        if sens.model != str(args.model):
            raise ToolkitError(f"{args.reuse}: measured for {sens.model}; --model is {args.model}")
        check_table(sens, cfg, args.reuse)
        if "imatrix" in table:
            from .quant.imatrix import load_imatrix

            if not isinstance(table["imatrix"], str):
                raise ToolkitError(f"{args.reuse}: 'imatrix' must be the name of a file beside the table")
            sens.imatrix = load_imatrix(importance_beside(args.reuse, table["imatrix"], f"{args.reuse}: 'imatrix'"))
    else:
        with compile_watch(on_first=_compiling(args)), tqdm(total=n_items, desc="measuring experts", unit="expert") as bar:
            sens = calibrate(args.model, args.calib_text, args.calib_start, args.calib_tokens, formats, progress=bar,
                             allow_outside=args.allow_outside)
    if joint:
        from .quant.joint_cli import plan_joint

        plan, header, host = plan_joint(args, cfg, sens, trace)
        _write_plan(args, plan, sens, header, host)
        print(f"wrote {args.out}: a format and a place for each of {len(plan)} expert projections\nnext: moqe generate "
              f"--model {args.model} --plan {args.out} --backend cuda (or cuda-emu)")
        return 0
    items = items_from(sens)
    params = sum(math.prod(s) for s in sens.shapes.values())
    budget = int(args.budget_mb * 1e6) if args.budget_mb is not None else int(args.bits_per_weight * params / 8)
    plan = solve(items, budget)
    used, loss = sum(c.nbytes for c in plan.values()), sum(c.loss for c in plan.values())
    counts: dict = {}
    for c in plan.values():
        counts[c.fmt] = counts.get(c.fmt, 0) + 1
    header = [f"moqe plan: {args.model}, budget {budget:,} bytes of routed experts ({8 * budget / params:.3f} bits/weight)",
              f"calibration: {sens.calibration}",
              f"planned: {used:,} bytes ({8 * used / params:.3f} bits/weight), predicted loss {loss:.6g}",
              "one line per routed expert projection: layers.LAYER.moe.{gate_up,down}.EXPERT=FORMAT"]
    n_cal = _write_plan(args, plan, sens, header)
    rows = [{"configuration": "plan", "bytes": used, "bits/weight": 8 * used / params, "predicted loss": loss}]
    for f in sens.formats:
        b, l = uniform(items, f)
        rows.append({"configuration": f"uniform {f}", "bytes": b, "bits/weight": 8 * b / params,
                     "predicted loss": rtn_loss(sens, f), "with calibrated scales": l})
    unit = "predicted mean KLD, nats" if sens.factors else "summed squared output error"
    print_table(rows, f"routed experts: planned mix against uniform formats (predicted loss: {unit})")
    print_table([{"format": f, "expert projections": n} for f, n in sorted(counts.items())], "the plan")
    if args.verbose:  # routing and the chosen formats, expert by expert
        total = {i: sum(s.tokens for (j, _), s in sens.stats.items() if j == i) for i, _ in sens.stats}
        print_table([{"layer": i, "expert": e, "routed tokens": s.tokens, "share": f"{100 * s.tokens / max(1, total[i]):.1f} %",
                      "routing weight": s.weight_sum, "forced tokens": s.forced,
                      "gate/up": plan[f"layers.{i}.moe.gate_up.{e}"].fmt, "down": plan[f"layers.{i}.moe.down.{e}"].fmt}
                     for (i, e), s in sorted(sens.stats.items())], "experts: calibration routing and the planned formats")
    forced = sum(1 for s in sens.stats.values() if s.forced)
    print(f"wrote {args.out}: {len(plan)} expert projections, {n_cal} of them with calibrated scales "
          f"({Path(args.out).name + '.imatrix.safetensors' if n_cal else 'none'}); {forced} expert(s) measured on tokens forced through them "
          f"(routed fewer than 32 calibration tokens)\nnext: moqe quantize --model {args.model} --plan {args.out} --out DIR")
    return 0


def _write_plan(args, plan: dict, sens, header: list, host=None) -> int:
    """Write the plan file (with its importance file beside it, and ``--sensitivity``'s table), every file or none,
    under the write rule; returns how many items use calibrated scales."""
    from pathlib import Path

    from .quant.plan import imatrix_path, plan_files
    from .writes import check_file_target, publish

    targets = _targets(args)  # the write rule again, now that the files are about to be written
    files, n_cal = plan_files(args.out, plan, sens, header, host)
    if args.sensitivity:
        import json

        table = sens.to_json()
        if sens.imatrix:
            from .quant.imatrix import save_imatrix

            side = imatrix_path(args.sensitivity)
            check_file_target(side, "imatrix", _inputs(args, skip=targets), args.force, "--sensitivity")
            table["imatrix"] = side.name
            files[side] = lambda tmp: save_imatrix(tmp, sens.imatrix)
        text = json.dumps(table, indent=1)
        files[Path(args.sensitivity)] = lambda tmp: Path(tmp).write_text(text, encoding="utf-8")
    publish(files)  # every file or none
    return n_cal


def cmd_info(args) -> int:
    """Architecture, parameter counts (experts / attention / other) and bytes."""
    from .bench.timing import print_table
    from .model import Checkpoint, load_config
    from .model.inspect import parameter_summary, parts

    from .uqff import is_bundle

    if is_bundle(args.model):
        args.bundle = args.model
        rc = cmd_uqff_inspect(args)
        _placement_table(args, load_config(args.model, args.allow_outside))
        _ep_table(args, load_config(args.model, args.allow_outside))
        return rc
    from .gguf.read import gguf_info, is_gguf

    if is_gguf(args.model):  # a GGUF file: its hyperparameters, and its tensors by GGML type
        cfg, rows = gguf_info(args.model)
    else:
        cfg = load_config(args.model, args.allow_outside)
        rows = parameter_summary(Checkpoint(args.model, args.allow_outside), cfg)
    c = cfg
    heads = f"heads {c.num_heads} (MLA)" if c.mla else f"heads {c.num_heads}/{c.num_kv_heads} (head dim {c.head_dim})"
    print(f"{args.model}: {c.family.name}, {c.num_layers} layers, hidden {c.hidden_size}, {heads}, experts {c.num_experts} top-{c.top_k} (intermediate {c.expert_intermediate}"
          f"{f', shared {c.shared_intermediate}' if c.shared_intermediate else ''}), vocab {c.vocab_size}, "
          f"rope {c.rope_type} theta {c.rope_theta:g}, context {c.max_position_embeddings}, stored as {c.torch_dtype}")
    print_table(parts(c), "parts")
    print_table(rows, "parameters")
    if is_gguf(args.model):
        from .gguf.read import gguf_resident

        print(f"expected resident on the CPU (Numba backend), as stored: {gguf_resident(args.model) / 1e9:.2f} GB "
              "(quantized tensors as the kernels hold them; the KV cache and about 0.15 GB of runtime on top)")
    else:
        from .model.inspect import resident_estimate

        print_table(resident_estimate(c), "expected resident on the CPU (Numba backend), experts quantized at load "
                                          "(--experts F, policy moqe); the KV cache and about 0.15 GB of runtime on top")
    from .model.kv_cache import CACHE_TYPES, cache_bytes_per_token

    kv_rows = []
    heads, row, shared = c.kv_layout
    for t in CACHE_TYPES:
        try:
            kv_rows.append({"KV cache": t, "bytes per token": cache_bytes_per_token(c.num_layers, heads, row, (t, t), shared)})
        except Exception as e:  # a head dim that blocks of 32 do not divide
            kv_rows.append({"KV cache": t, "bytes per token": f"n/a ({e})"})
        if c.mla is not None:  # what the expanded per-head keys and values would take
            m = c.mla
            kv_rows[-1]["expanded K and V (f32)"] = 4 * c.num_layers * c.num_heads * (m.qk_head_dim + m.v_head_dim)
    print_table(kv_rows, "KV cache memory")
    _placement_table(args, c)
    _ep_table(args, c)
    return 0


def _ep_table(args, cfg) -> None:
    """``moqe info --ep N``: each expert rank's routed experts and bytes, and the driver's (docs/expert-parallel.md)."""
    if _ep(args) is None:
        return
    from .bench.timing import print_table
    from .dist import split_for
    from .dist.info import rank_rows

    split = split_for(cfg, args.ep, args.ep_split)
    for f in (args.experts.split(",") if args.experts else [None]):
        rows = rank_rows(cfg, split, f)
        print_table(rows, f"--ep {args.ep} ({split.label}), experts {f or 'f32'}: routed experts per rank as the Numba "
                          f"kernels hold them; the driver holds the rest (attention, router, shared experts, embeddings, "
                          f"head) and the KV cache")


def _placement_table(args, cfg) -> None:
    """``moqe info`` with a placement flag: where the bytes live on a device and the bus bytes per token."""
    from .bench.timing import print_table

    spec = _placement(args)
    if spec is None:
        return
    from .model.placement import resolve_places, where_bytes

    places = resolve_places(spec, cfg, "cuda-emu")
    if places is None:
        print(f"placement {spec.label}: every routed expert stays on the device")
        return
    print_table([where_bytes(cfg, places, f) for f in (args.experts.split(",") if args.experts else [None])],
                f"placement {spec.label} on a device: routed experts by side (device: as uploaded; host: as the "
                f"Numba kernels hold them); attention, router, shared experts, embeddings, head and KV cache on the device")


def cmd_trace(args) -> int:
    """Record which routed experts a text uses: per MoE layer, each expert's tokens and the pairs chosen together
    (``toolkit/quant/trace.py``), saved as a routing trace; prints each layer's busiest experts."""
    from pathlib import Path

    import numpy as np
    from tqdm import tqdm

    from .bench.timing import print_table
    from .files import read_text
    from .quant import trace as routing
    from .warmup import compile_watch
    from .writes import publish

    if args.window < 2:
        raise ToolkitError(f"--window must be at least 2 tokens, got {args.window}")
    if args.max_tokens < 0:
        raise ToolkitError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    text = read_text(args.text, "text file")
    with compile_watch(on_first=_compiling(args)):
        model, tok = _load(args)
        ids = _text_ids(args, tok, model, text)
        if not ids:
            raise ToolkitError(f"{args.text}: no tokens to trace")
        window = min(args.window, model.cfg.max_position_embeddings)
        with tqdm(total=len(ids), desc="tracing", unit="token") as bar:
            t = routing.record(model, ids, window, keep_ids=args.ids, progress=bar, source=str(args.text))
    targets = _targets(args)  # the write rule again, now that the file is about to be written
    publish({Path(targets[0]): lambda tmp: routing.save(tmp, t)})
    shares = t.shares()
    rows = []
    for j, i in enumerate(t.layers):
        top = np.argsort(-t.counts[j], kind="stable")[:4]
        rows.append({"layer": i, "experts used": int((t.counts[j] > 0).sum()), "of": t.experts,
                     "busiest / mean": float(t.imbalance()[j]),
                     "busiest experts (share)": ", ".join(f"{e} ({100 * shares[j, e]:.1f} %)" for e in top)})
    print_table(rows, f"routing of {t.tokens} tokens of {args.text}, top-{t.top_k} of {t.experts} experts")
    print(f"wrote {args.out}: counts and co-activation pairs of {len(t.layers)} MoE layer(s)"
          + (", and each token's experts" if args.ids else ""))
    return 0


# ---- what a command reads and writes: declared on its arguments, checked once for every command (main) --------
def _arg(p: argparse.ArgumentParser, *flags, writes: str | None = None, reads: str | None = None, **kw):
    """``add_argument`` that also declares a written target (``writes``: a kind of :data:`toolkit.writes.KINDS`,
    or ``bundle`` for a bundle folder) or a read input (``reads``: ``model``, or what the file is: ``text file``). :func:`main` applies the
    write rule to every declared target against every declared input before the command runs; the tests build
    their tables of cases from these declarations (tests/damage/targets.py)."""
    a = p.add_argument(*flags, **kw)
    a.moqe_writes, a.moqe_reads = writes, reads
    return a


def _declare_io(p: argparse.ArgumentParser) -> None:
    """Record the parser's declared targets and inputs as defaults: ``_writes``/``_reads`` [(dest, flag, kind)]."""
    def of(attr):
        return [(a.dest, a.option_strings[0] if a.option_strings else a.dest, getattr(a, attr)) for a in p._actions
                if getattr(a, attr, None)]

    p.set_defaults(_writes=of("moqe_writes"), _reads=of("moqe_reads"))
    if any(kind != "bundle" for _, _, kind in of("moqe_writes")):
        p.add_argument("--force", action="store_true",
                       help="replace an existing file that this toolkit did not write (never an input of the command)")


def _named_imatrix(path) -> list:
    """The importance file a plan (``#! imatrix=NAME``) or a sensitivity table (``"imatrix"``) names, and the
    conventional one beside it: inputs too, whether or not the command gets to read them."""
    from pathlib import Path

    from .quant.plan import imatrix_lines, imatrix_path

    p, out = Path(path), [imatrix_path(path)]
    try:
        if p.is_file() and p.stat().st_size < (64 << 20):
            text = p.read_text(encoding="utf-8", errors="replace")
            out += [p.parent / name for _, name in imatrix_lines(text)]
            if text.lstrip().startswith("{"):
                import json

                name = json.loads(text).get("imatrix")
                if isinstance(name, str):
                    out.append(p.parent / name)
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return [x for x in out if str(x.name)]


def _inputs(args, skip=()) -> list:
    """(path, role) of everything the command reads (``skip``: paths that are this command's own targets)."""
    out = []
    for dest, flag, kind in getattr(args, "_reads", ()):
        value = getattr(args, dest, None)
        if value is None or not str(value):
            continue
        out.append((value, "the source model" if kind == "model" else f"the {flag} file"))
        if dest in ("plan", "reuse"):
            out += [(x, f"the importance file of {flag}") for x in _named_imatrix(value)]
    return [(p, r) for p, r in out if str(p) not in {str(s) for s in skip}]


def _check_reads(args) -> None:
    """The read rule's first step for every declared input: never an empty name; a file input is an existing
    regular file (a FIFO, a device or a folder is refused before anything opens it)."""
    from .files import check_regular

    for dest, flag, kind in getattr(args, "_reads", ()):
        value = getattr(args, dest, None)
        if value is None:
            continue
        if not str(value).strip():
            raise ToolkitError(f"{flag} is empty; give a {'model folder or file' if kind == 'model' else kind}")
        if kind != "model":  # a file: ``kind`` names it ("text file")
            check_regular(value, kind)


def _targets(args) -> list:
    """Apply the write rule (:mod:`toolkit.writes`) to every target the command declared -> their paths."""
    import os
    from pathlib import Path

    from .quant.plan import imatrix_path
    from .writes import check_file_target

    declared = [(getattr(args, dest, None), flag, kind) for dest, flag, kind in getattr(args, "_writes", ())]
    declared = [(v, flag, kind) for v, flag, kind in declared if v is not None]
    for v, flag, kind in list(declared):  # the importance file written beside a plan or a table
        if kind in ("plan", "table") and str(v).strip():
            declared.append((imatrix_path(v), f"{flag} (its importance file)", "imatrix"))
    inputs = _inputs(args)
    seen: dict = {}
    for value, flag, kind in declared:
        if not str(value).strip():
            raise ToolkitError(f"{flag} is empty; give the {'folder' if kind == 'bundle' else 'file name'} to write")
        if kind == "bundle":
            from .uqff.writer import check_out

            check_out(Path(value), Path(args.model), [i for i in inputs if i[1] != "the source model"])
        else:
            check_file_target(value, kind, inputs, getattr(args, "force", False), flag)
        real = os.path.realpath(value)
        if real in seen:
            raise ToolkitError(f"{flag} and {seen[real]} name the same file {value}; give each its own")
        seen[real] = flag
    return [v for v, _, _ in declared]


def _model_args(p: argparse.ArgumentParser) -> None:
    from .formats import describe_specs

    _arg(p, "--model", reads="model", default=DEFAULT_MODEL, help="model directory (default: the bundled model, %(default)s)")
    p.add_argument("--backend", default="numba", choices=["numpy", "numba", "cuda", "cuda-emu"],
                   help="numba, numpy (the reference), cuda (a GPU), cuda-emu (the CUDA kernels emulated on the CPU: slow); "
                        "default %(default)s")
    p.add_argument("--policy", choices=["none", "moqe", "all-linear"], default=None,
                   help="quantization policy (default: moqe when --experts is given, else none)")
    p.add_argument("--experts", default=None, metavar="FORMAT",
                   help=f"format of the policy's weights: {describe_specs()}")
    p.add_argument("--override", action="append", metavar="REGEX=FORMAT",
                   help="per-weight override, e.g. 'down=int8' (repeatable; 'none' keeps full precision)")
    _arg(p, "--plan", reads="plan file", default=None, metavar="FILE",
                   help="a plan file from 'moqe plan': one format per routed expert projection (experts at mixed widths)")
    p.add_argument("--kv-cache", default=None, metavar="TYPE",
                   help="KV cache type: f32, q8_0, q4_0, or 'k=q8_0,v=q4_0' (default f32)")
    p.add_argument("--kv-rotate", choices=["auto", "on", "off"], default="auto",
                   help="store keys (and read queries) rotated by a Hadamard matrix, so a quantized K cache spreads "
                        "outliers across its blocks (default %(default)s: on for q4_0 keys, where it measured best; see docs/kv-cache.md)")
    p.add_argument("--allow-outside", action="store_true",
                   help="follow symlinks that leave the model folder (refused by default)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the kernels and BLAS (default: every core; 1 = serial)")
    p.add_argument("--activations", choices=["f32", "int8"], default=None,
                   help="the expert GEMMs' activations on the numba backend (default int8): int8 quantizes them to 8-bit "
                        "blocks of 32 for int8/int4/int3/int2/q8_0/q4_0 experts and runs integer dot products (2-8x "
                        "faster; its quality cost is in the KLD table of docs/speed.md); f32 keeps them exact. On "
                        "cuda / cuda-emu with experts on the host, the host experts' activations")


def _placement_args(p: argparse.ArgumentParser) -> None:
    """Where the routed experts live on cuda / cuda-emu (docs/placement.md): llama.cpp's two knobs and a file."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cpu-moe", action="store_true",
                   help="keep every routed expert on the host (run by the Numba kernels); attention, router, shared "
                        "experts, embeddings, head and KV cache stay on the device (llama.cpp's --cpu-moe)")
    g.add_argument("--n-cpu-moe", type=int, default=None, metavar="N",
                   help="keep the routed experts of layers 0..N-1 on the host (llama.cpp's --n-cpu-moe)")
    _arg(g, "--placement", reads="placement file", default=None, metavar="FILE",
         help="a placement file: lines 'layers.I.experts=host' or 'layers.I.experts.E=host|device' (others: device)")


def _ep_args(p: argparse.ArgumentParser, run: bool = True) -> None:
    """Expert parallelism on Ray (docs/expert-parallel.md): the routed experts on N expert ranks."""
    from .numbers import flag, whole

    p.add_argument("--ep", type=flag(whole, lo=1, hi=4096), default=None, metavar="N",
                   help="put the routed experts on N expert ranks (Ray actors), each loading only its own experts; "
                        "this process keeps attention, router, shared experts, embeddings, head and KV cache"
                        if run else "the bytes each of N expert ranks would hold (--ep of generate / perplexity)")
    if run:
        p.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --ep: the Ray cluster to run the ranks on (default: a local Ray started for this run)")
        p.add_argument("--ep-cpus", type=flag(whole, lo=1, hi=1 << 16), default=1, metavar="N",
                       help="with --ep: CPUs each rank asks Ray for, and its kernels' threads (default %(default)s; "
                            "a rank per machine: that machine's cores)")
        p.add_argument("--ep-transport", choices=("graph", "calls"), default="graph",
                       help="with --ep: the hop's transport (default %(default)s). graph: a Ray Compiled Graph, the "
                            "least time per hop, but each rank and this process hold a core at 100%% while they wait, "
                            "idle too; calls: Ray actor calls, about 1 ms more per hop, no CPU while waiting")
    _arg(p, "--ep-split", reads="routing trace", default=None, metavar="TRACE",
         help="with --ep: balance the ranks' expected tokens from a routing trace (moqe trace) instead of the "
              "contiguous split")


def build_parser() -> argparse.ArgumentParser:
    from .numbers import flag, real, whole
    from .quant.joint import BUS_GBS, DEVICE_GBS, HOP_US
    from .quant.sensitivity import CALIBRATION_START, CALIBRATION_TOKENS, CANDIDATES
    from .formats import describe_specs
    from .warmup import FAMILIES_ALL, GGML_ONLY, KV_ALL

    ap = argparse.ArgumentParser(prog="moqe", description="MoQE Toolkit: MoE inference with quantized experts, no framework.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("formats", help="list the quantization formats")
    _declare_io(p)
    p.set_defaults(func=cmd_formats)

    p = sub.add_parser("generate", help="generate text from a prompt (streamed)")
    _model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64, help="default %(default)s")
    p.add_argument("--temperature", type=float, default=0.0, help="default %(default)s (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens (default %(default)s: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default %(default)s: all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="default %(default)s (1: none)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--compiled-decode", choices=["auto", "on", "cached", "off"], default="auto",
                   help="numba: run each layer at one token as one compiled call (the same bits as the staged ops); "
                        "auto: when the kernel cache holds it, else this run decodes on the staged ops and the step "
                        "compiles in the background for later runs; on: compiled on first use, in the foreground; "
                        "cached: only when moqe warmup or an earlier run compiled it; off: the staged ops "
                        "(default %(default)s)")
    _placement_args(p)
    _ep_args(p)
    p.add_argument("--verbose", action="store_true", help="also say which decode path ran (compiled step or staged ops)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="with --backend cuda: replay the decode step as a captured CUDA graph")
    _declare_io(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    _model_args(p)
    _placement_args(p)
    _ep_args(p)
    _arg(p, "--text", reads="text file", required=True)
    p.add_argument("--window", type=int, default=0,
                   help="tokens per window (default %(default)s: min(256, context); the bundled model was trained on 256)")
    p.add_argument("--stride", type=int, default=0, help="tokens between windows (default %(default)s: window/2)")
    p.add_argument("--max-tokens", type=int, default=0, help="score only the first N tokens (default %(default)s: all)")
    p.add_argument("--kld", action="store_true",
                   help="also the KL divergence from the full-precision model on the same tokens (mean, 99th "
                        "percentile, max), top-1 agreement, and the router's fidelity per MoE layer (top-k overlap, "
                        "flip rate); loads the checkpoint a second time, unquantized")
    _declare_io(p)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("trace", help="record which routed experts a text uses: per layer, each expert's tokens "
                                     "and the pairs chosen together (a routing trace file)")
    _model_args(p)
    _placement_args(p)
    _arg(p, "--text", reads="text file", required=True)
    _arg(p, "--out", writes="trace", required=True, metavar="FILE", help="the routing trace to write (safetensors)")
    p.add_argument("--window", type=int, default=256, help="tokens per forward pass (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=0, help="trace only the first N tokens (default %(default)s: all)")
    p.add_argument("--ids", action="store_true",
                   help="also keep each token's chosen experts (for router fidelity between two traces)")
    _declare_io(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("quantize", help="quantize a model with a policy and report formats and bytes")
    _model_args(p)
    p.add_argument("--verbose", action="store_true", help="list every weight")
    _arg(p, "--out", writes="bundle", default=None, metavar="DIR",
         help="write a UQFF bundle to DIR (atomically; DIR must be new, empty, or a bundle this toolkit wrote)")
    p.add_argument("--shard-size", default="10GiB", metavar="SIZE", help="cap of one .uqff shard (default %(default)s)")
    _declare_io(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("export", help="write a model, quantized by a policy, as a GGUF file llama.cpp loads")
    _model_args(p)
    _arg(p, "--gguf", writes="gguf", required=True, metavar="OUT.gguf", help="the GGUF file to write (atomically)")
    _declare_io(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("uqff", help="UQFF bundles")
    usub = p.add_subparsers(dest="uqff_command", required=True)
    q = usub.add_parser("inspect", help="version, layers by format and bytes of a bundle (no weights loaded)")
    _arg(q, "bundle", reads="model", metavar="OUT")
    q.add_argument("--allow-outside", action="store_true", help="follow symlinks that leave the bundle folder")
    _declare_io(q)
    q.set_defaults(func=cmd_uqff_inspect)

    p = sub.add_parser("warmup", help="compile the kernels once (a cold Numba cache), so later runs start at once")
    p.add_argument("--experts", default=None, metavar="LIST",
                   help=f"expert formats, comma-separated (default: {', '.join(FAMILIES_ALL)}; also {describe_specs(GGML_ONLY)})")
    p.add_argument("--kv-cache", default=None, metavar="LIST", help=f"KV cache types, comma-separated (default: {','.join(KV_ALL)})")
    p.add_argument("--policy", action="append", choices=["moqe", "all-linear"], default=None,
                   help="policies to warm (default both: all-linear adds one-token products of quantized "
                        "attention, with kernel builds of their own)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="compile in N worker processes (0: one per core), then check every kernel loads from the cache "
                        "(default %(default)s)")
    p.add_argument("--activations", dest="warm_activations", default=None, metavar="LIST",
                   help="expert activation kinds to warm, comma-separated: int8 (the default's kernels), f32 (those of "
                        "--activations f32), or both")
    _declare_io(p)
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("plan", help="plan each routed expert's format under a byte budget (calibrated sensitivity, "
                                    "multiple-choice knapsack) and write a plan file for 'moqe quantize --plan'")
    _arg(p, "--model", reads="model", default=DEFAULT_MODEL, help="model directory (default: the bundled model, %(default)s)")
    p.add_argument("--budget-mb", type=flag(real, lo=0, lo_open=True, hi=1e15), default=None, metavar="N", help="routed expert bytes, in MB (1e6)")
    p.add_argument("--bits-per-weight", type=flag(real, lo=0, lo_open=True, hi=64), default=None, metavar="B",
                   help="or the budget as average stored bits per routed expert weight (scales included)")
    _arg(p, "--calib-text", reads="calibration text", default=str(__import__("pathlib").Path(DEFAULT_MODEL).parent / "heldout.txt"),
                   metavar="FILE", help="calibration text, read from --calib-start on (default %(default)s)")
    p.add_argument("--calib-start", type=flag(whole, hi=1 << 40), default=CALIBRATION_START, metavar="N",
                   help="first calibration token (default %(default)s: evaluation scores the held-out tokens before it)")
    p.add_argument("--calib-tokens", type=flag(whole, hi=1 << 40), default=CALIBRATION_TOKENS, metavar="N",
                   help="calibration tokens (default %(default)s; 0: every token from --calib-start on)")
    p.add_argument("--formats", default=None, metavar="LIST",
                   help=f"candidate formats, comma-separated (default: {', '.join(CANDIDATES)})")
    _arg(p, "--out", writes="plan", required=True, metavar="FILE", help="the plan file to write (atomically)")
    _arg(p, "--sensitivity", writes="table", default=None, metavar="FILE.json", help="also write the measured sensitivity table")
    p.add_argument("--verbose", action="store_true", help="also list each expert's routing and planned formats")
    g = p.add_argument_group("formats and places together (a device and a host: docs/placement.md)")
    g.add_argument("--vram", type=flag(real, lo=0, lo_open=True, hi=1e6), default=None, metavar="GB",
                   help="device memory for the model (GB, 1e9): attention and the rest first, routed experts in what is left")
    g.add_argument("--ram", type=flag(real, lo=0, hi=1e6), default=None, metavar="GB", help="host memory for routed experts (GB)")
    _arg(g, "--trace", reads="routing trace", default=None, metavar="FILE",
         help="a routing trace (moqe trace) of the text the model will serve: each expert's uses per token")
    g.add_argument("--budget-kld", type=flag(real, lo=0, hi=1e6), default=None, metavar="X",
                   help="the least expected time per token whose predicted loss stays within X")
    g.add_argument("--target", type=flag(real, lo=0, lo_open=True, hi=1e9), default=None, metavar="TOK/S",
                   help="the least predicted loss at an expected speed of at least TOK/S tokens per second")
    g.add_argument("--device-gbs", type=flag(real, lo=0, lo_open=True, hi=1e6), default=DEVICE_GBS, metavar="GB/S",
                   help="the device's bandwidth for expert GEMVs (default %(default)s: an H200 at about 40 %% of its 4.8 TB/s)")
    g.add_argument("--bus-gbs", type=flag(real, lo=0, lo_open=True, hi=1e6), default=BUS_GBS, metavar="GB/S",
                   help="host <-> device bandwidth (default %(default)s: PCIe 4.0 x16)")
    g.add_argument("--hop-us", type=flag(real, lo=0, hi=1e6), default=HOP_US, metavar="US",
                   help="fixed cost of one layer with host experts: copies and the wait (default %(default)s)")
    g.add_argument("--host-gbs", default=None, metavar="F=GB/S,...",
                   help="host GEMV GB/s per format (default: measured now, one token through the Numba experts)")
    _arg(p, "--reuse", reads="sensitivity table", default=None, metavar="FILE.json",
                   help="plan from a sensitivity table written before by --sensitivity (no calibration run)")
    p.add_argument("--allow-outside", action="store_true", help="follow symlinks that leave the model folder")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: every core)")
    _declare_io(p)
    p.set_defaults(func=cmd_plan, experts=None, kv_cache=None)

    p = sub.add_parser("serve", help="serve the model over HTTP with OpenAI's API (/v1/completions, "
                                     "/v1/chat/completions), continuous batching and Prometheus /metrics")
    _model_args(p)
    _placement_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=flag(whole, lo=0, hi=65535), default=8000, help="default %(default)s (0: any free port)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name clients ask for in 'model' (default: the model folder's or file's name)")
    p.add_argument("--slots", type=flag(whole, lo=1, hi=1024), default=16,
                   help="sequences decoded together at most: the KV cache holds this many (default %(default)s)")
    p.add_argument("--context", type=flag(whole, lo=1, hi=1 << 24), default=None,
                   help="tokens per sequence, prompt and completion (default: the model's, at most 4096)")
    p.add_argument("--max-queue", type=flag(whole, lo=0, hi=1 << 20), default=64,
                   help="requests waiting at most; more are refused with 503 (default %(default)s)")
    p.add_argument("--prefill-chunk", type=flag(whole, lo=1, hi=1 << 20), default=512,
                   help="prompt tokens of each sequence per engine step (default %(default)s)")
    p.add_argument("--prefill-tokens", type=flag(whole, lo=1, hi=1 << 24), default=2048,
                   help="prompt tokens that may join one prefill batch (default %(default)s)")
    p.add_argument("--no-expert-stats", action="store_true",
                   help="do not count the routed experts per layer in /metrics (numba: lets one sequence decode "
                        "through the compiled decode step; cuda: lets the decode step be recorded and replayed)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level (default %(default)s)")
    _declare_io(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="architecture, parameter counts and bytes of a model")
    _arg(p, "--model", reads="model", default=DEFAULT_MODEL,
         help="model directory, UQFF bundle or GGUF file (default: the bundled model, %(default)s)")
    _placement_args(p)
    p.add_argument("--experts", default=None, metavar="F[,F...]",
                   help="with a placement flag or --ep: the routed experts' format(s) to count (default: unquantized, f32)")
    _ep_args(p, run=False)
    p.add_argument("--allow-outside", action="store_true", help="follow symlinks that leave the model folder")
    _declare_io(p)
    p.set_defaults(func=cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command (:func:`_main`). As the ``moqe`` console script, a Ctrl-C after the command has finished
    (while Python shuts down, when it has put the default handler back) no longer kills it with no word."""
    import signal

    from . import _CONSOLE

    try:
        return _main(argv)
    finally:
        if _CONSOLE and argv is None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input: one line naming what is wrong, rc 2. Anything unexpected: one line naming
    the error and the file holding the full report (``toolkit.crash``), rc 1. Ctrl-C: one line, rc 130
    (:mod:`toolkit.interrupt`). Never a traceback."""
    import contextlib

    from .crash import one_line, report
    from .interrupt import INTERRUPTED, handling

    name, stack = "moqe", contextlib.ExitStack()
    try:  # from the first moment: Ctrl-C while parsing or importing is one line and rc 130 too
        stack.enter_context(handling())
        args = build_parser().parse_args(argv)
        name = f"moqe {args.command}" + (f" {args.uqff_command}" if getattr(args, "uqff_command", None) else "")
        _check_reads(args)  # the read rule and the write rule, before any work is done
        _targets(args)
        if getattr(args, "threads", None) is not None or hasattr(args, "model"):
            from .threads import set_threads

            set_threads(getattr(args, "threads", None))
        if getattr(args, "activations", None) is not None and _placement(args) is None:
            if args.activations != "f32" and args.backend != "numba":
                raise ToolkitError(f"--activations {args.activations} is a numba backend path (got --backend {args.backend})")
        import warnings

        with warnings.catch_warnings():  # a warning is one line naming the command, like an error
            warnings.showwarning = lambda message, *a, **k: print(f"{name}: warning: {message}", file=sys.stderr)
            return args.func(args)
    except ToolkitError as e:
        print(f"{name}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a reader that stopped (head, less)
        sys.stderr.close()
        return 1
    except Exception as e:  # noqa: BLE001 - the edge: nothing unexpected reaches the user as a traceback
        if INTERRUPTED.is_set():  # the error followed a Ctrl-C that a C callback swallowed (a broken compile)
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        path = report(e, " ".join(sys.argv if argv is None else ["moqe", *argv]))
        where = f"; the full report is in {path}" if path else ""
        print(f"{name}: internal error ({type(e).__name__}: {one_line(e, 300)}){where}", file=sys.stderr)
        return 1
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
