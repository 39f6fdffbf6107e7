"""``python -m toolkit.bench memory``: peak resident memory per load path, beside llama.cpp's on the same file.

Each ``--model`` (a GGUF file, a UQFF bundle folder, or a Hugging Face checkpoint folder quantized at load with
``--experts F``, policy moqe) is loaded in a fresh Python process by ``load_model`` (Numba backend), which then
prefills ``--prompt-tokens`` tokens and decodes ``--new-tokens``. The row reports that process's resident set
after loading and at its peak (the load, the packing and the generation included), and what the
loaded weights hold (``weights GB``: every array the model keeps, packed layouts included).

With ``--llama-cpp DIR``, every GGUF row also runs ``llama-bench`` on the same file (same prompt and new tokens,
``-ctk/-ctv`` the ``--kv-cache`` type, ours the same); ``vs llama.cpp`` = ours / theirs. Every peak is the
program's own ``VmHWM`` (``timing.peak_of``); both count the mapped file pages the process touched.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..mapped import resident
from .timing import conditions, peak_of, print_table

GB = 1e9


def ours_in_child(model: str, experts: str | None, prompt: int, new: int, kv: str, threads: int) -> dict:
    """One load path in a fresh process: its row (the child prints it as JSON)."""
    code = ("import json, sys; from toolkit.bench.memory import _child; "
            f"print(json.dumps(_child({model!r}, {experts!r}, {prompt}, {new}, {kv!r}, {threads})))")
    rc, out, err, peak = peak_of([sys.executable, "-c", code])
    if rc != 0:
        return {"error": " | ".join(err.strip().splitlines()[-2:])[:300]}
    row = json.loads(out.strip().splitlines()[-1])
    row["peak GB"] = peak / GB
    return row


def _child(model: str, experts: str | None, prompt: int, new: int, kv: str, threads: int) -> dict:
    from ..load import load_model
    from ..quant import parse_policy
    from .anchors import prompt_ids, time_generation
    from .timing import set_threads

    set_threads(threads)
    t0 = time.perf_counter()
    m, tok = load_model(model, backend="numba", policy=parse_policy("moqe", experts) if experts else None,
                        kv_cache=kv)
    load_s = time.perf_counter() - t0
    after = resident()
    ids, _ = prompt_ids(tok, prompt - (tok.bos_token_id is not None))
    time_generation(m, ids, new)  # its peak counts (rates: bench layer / anchors, after a warm-up)
    return {"load s": load_s, "RSS after load GB": after["rss"] / GB, "weights GB": m.resident_bytes() / GB}


def llama_peak(bench: Path, gguf: str, prompt: int, new: int, kv: str, threads: int) -> dict:
    """llama-bench on the same file: its peak resident bytes (its thread count and KV type read back)."""
    cmd = [str(bench), "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", "-ctk", kv, "-ctv", kv,
           "-p", str(prompt), "-n", str(new)]
    rc, out, err, peak = peak_of(cmd)
    if rc != 0:
        return {"error": "llama-bench failed: " + " | ".join(err.strip().splitlines()[-2:])[:300]}
    runs = json.loads(out)
    if any(r.get("n_threads", threads) != threads or r.get("type_k") != kv for r in runs):
        return {"error": f"llama-bench ran {[(r.get('n_threads'), r.get('type_k')) for r in runs]}, not {threads} x {kv}"}
    return {"peak GB": peak / GB}


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="PATH",
                    help="a GGUF file, a UQFF bundle or a checkpoint folder (repeatable)")
    ap.add_argument("--experts", help="for a checkpoint folder: the experts' format, quantized at load")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--kv-cache", default="q8_0", choices=["q8_0", "q4_0"], help="both sides (llama-bench has no f32)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp build (llama-bench) for the GGUF rows")
    args = ap.parse_args(argv)
    from ..gguf.read import is_gguf
    from .anchors import LlamaCpp

    print(conditions([args.threads]), flush=True)
    bench = LlamaCpp(args.llama_cpp).bench if args.llama_cpp else None
    rows = []
    for path in args.model:
        gguf = is_gguf(path)
        kind = "GGUF" if gguf else "UQFF bundle" if (Path(path) / "residual.safetensors").exists() else "checkpoint"
        experts = None if gguf or kind == "UQFF bundle" else args.experts
        p = Path(path)
        files = ([f for f in p.rglob("*") if f.is_file()] if kind == "UQFF bundle" else list(p.glob("*.safetensors"))) \
            if p.is_dir() else [p] if p.is_file() else []  # a checkpoint's weights, not what else its folder holds
        size = sum(f.stat().st_size for f in files) if files else None
        row = {"load path": kind + (f" + quantize {experts}" if experts else ""), "file": Path(path).name,
               "file GB": size / GB if size is not None else None}
        ours = ours_in_child(path, experts, args.prompt_tokens, args.new_tokens, args.kv_cache, args.threads)
        row.update({k: ours.get(k) for k in ("load s", "RSS after load GB", "weights GB", "peak GB")})
        note = ours.get("error", "")
        if gguf and bench is not None:
            ll = llama_peak(bench, path, args.prompt_tokens, args.new_tokens, args.kv_cache, args.threads)
            row["llama.cpp peak GB"] = ll.get("peak GB")
            row["vs llama.cpp"] = row["peak GB"] / ll["peak GB"] if "peak GB" in ll and row["peak GB"] else None
            note = (note + " " + ll.get("error", "")).strip()
        row["note"] = note
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows, f"memory: peak resident set per load path, {args.prompt_tokens}-token prompt + {args.new_tokens} "
                      f"new tokens, KV cache {args.kv_cache}, {args.threads} thread(s), Numba backend")
    return rows
