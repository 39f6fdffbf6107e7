"""``python -m toolkit.bench quality``: the MoQE table on the bundled model and its held-out text.

For ``none``, ``moqe`` and ``all-linear`` at each width: held-out perplexity (sliding window), the KL divergence
of each configuration's next-token distributions from the full-precision model's on the same tokens (mean, 99th
percentile) and their top-1 agreement, weight bytes, bits per weight of the quantized weights and of the whole
model, so a reader sees whether experts tolerate low bits better than attention (arXiv 2310.02410).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..cpu.moe_gemm import DEFAULT_ACTIVATIONS, parse_activations
from ..formats import get_format
from ..model import perplexity
from ..formats.int_form import supported
from ..load import load_model
from ..quant import QuantReport, parse_policy
from .timing import print_table

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = ["int8", "fp8", "int4-g64", "int4-g128", "int3-g64", "int3-g32", "int2-g64", "int2-g32"]


def configs(widths: list[str], presets: list[str]) -> list[tuple[str, str | None]]:
    """The full-precision baseline once, then every (preset, width); ``none`` in presets is that baseline."""
    return [("none", None)] + [(p, w) for p in presets if p != "none" for w in widths]


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench quality", description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--text", default=str(ROOT / "data" / "heldout.txt"))
    ap.add_argument("--widths", default=",".join(WIDTHS))
    ap.add_argument("--presets", default="moqe,all-linear")
    ap.add_argument("--max-tokens", type=int, default=8192, help="score the first N held-out tokens (0 = all)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--activations", default=DEFAULT_ACTIVATIONS,
                    help="expert GEMM activations to compare (numba): f32 and/or int8; a width the int8 path does not "
                         "apply to gets its f32 row only")
    args = ap.parse_args(argv)
    try:
        acts = parse_activations(args.activations)
    except ValueError as e:
        ap.error(str(e))

    rows = []
    ids = reference = None
    todo = [(p, w, "f32" if w is None else a) for p, w in configs(args.widths.split(","), args.presets.split(","))
            for a in (acts[:1] if w is None else acts) if w is None or a == "f32" or supported(get_format(w))]
    for preset, width, act in tqdm(todo, desc="configurations"):  # the baseline once (no quantized experts: f32)
        report = QuantReport(preset)
        t0 = time.perf_counter()
        model, tok = load_model(args.model, backend=args.backend, policy=parse_policy(preset, width), report=report,
                                activations=act if args.backend == "numba" else None)  # packed for the kernels that run
        t_load = time.perf_counter() - t0
        if ids is None:
            ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))
            ids = ids[: args.max_tokens] if args.max_tokens else ids
        reference = reference or model  # the first configuration is the full-precision baseline
        t0 = time.perf_counter()
        r = perplexity(model, ids, args.window, args.stride, reference=reference)
        t_ppl = time.perf_counter() - t0
        quant = [x for x in report.rows if x["format"] != "f32"]
        q_params = sum(int(np.prod(x["shape"])) for x in quant)
        q_bytes = sum(x["bytes"] for x in quant)
        all_params = sum(int(np.prod(x["shape"])) for x in report.rows)
        all_bytes = sum(x["bytes"] for x in report.rows)
        rows.append({"policy": preset, "format": width or "-", "activations": act if width else "-",
                     "perplexity": r["perplexity"],
                     "KLD mean": r["kld_mean"], "KLD p99": r["kld_p99"], "top-1 agree": f"{100 * r['top1_agreement']:.2f} %",
                     "quantized params": q_params, "bits/weight (quantized)": 8 * q_bytes / q_params if q_params else 32.0,
                     "weight MB": all_bytes / 1e6, "bits/weight (model)": 8 * all_bytes / all_params,
                     "load s": t_load, "eval tok/s (with the reference)": r["tokens"] / t_ppl})
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl vs none"] = f"{100 * (r['perplexity'] / base - 1):+.1f} %"
    print_table(rows, f"MoQE quality on {Path(args.model).name}: {len(ids)} held-out tokens of {Path(args.text).name}, "
                      f"window {args.window} stride {args.stride}; full precision = f32 compute of the fp16 checkpoint; "
                      "KLD = KL(full precision || configuration) per scored token, nats")
    return rows
