"""``python -m toolkit.bench kv``: the KV cache types (f32, q8_0, q4_0) measured in one process.

1. Attention shapes at a 2,048-token context: the bundled model's, and a Mixtral-sized layer (32 query
   heads, 8 KV heads, head dim 128): cache bytes per token, and the decode step (one new query attending
   to 2,048 cached tokens, one layer) time with its ratio to the f32 cache.
2. Held-out perplexity of the bundled model for each cache type, with expert quantization off and with
   ``moqe`` int4.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numba
import numpy as np
from tqdm import tqdm

from ..model import load_config, perplexity
from ..load import load_model
from ..model.kv_cache import KVCache
from ..quant import parse_policy
from .timing import median_seconds, print_table

ROOT = Path(__file__).resolve().parents[2]
TYPES = [("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")]


def attention_rows(name: str, H: int, Hkv: int, hd: int, ctx: int, reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, ctx, Hkv, hd)).astype(np.float32)
    v = rng.standard_normal((1, ctx, Hkv, hd)).astype(np.float32)
    q = rng.standard_normal((1, 1, H, hd)).astype(np.float32)
    rows, base = [], None
    for pair in TYPES:
        cache = KVCache(1, 1, Hkv, ctx, hd, pair)
        cache.write(0, k, v, np.arange(ctx)[None])
        pos = np.array([[ctx - 1]])
        t = median_seconds(lambda: cache.attention(0, q, pos, hd**-0.5, 0), reps=reps, warmup=2)
        base = base or t
        per_layer = cache.bytes_per_token
        rows.append({"shape": name, "cache K/V": "/".join(pair), "bytes/token/layer": per_layer,
                     "vs f32 size": f"{KVCache(1, 1, Hkv, 1, hd).bytes_per_token / per_layer:.2f}x smaller",
                     f"decode step us ({ctx} ctx)": t * 1e6, "time vs f32": t / base,
                     "cache GB/s": per_layer * ctx / t / 1e9})
    return rows


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench kv", description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--text", default=str(ROOT / "data" / "heldout.txt"))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256, help="the bundled model was trained on 256-token windows")
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--skip-perplexity", action="store_true")
    args = ap.parse_args(argv)

    cfg = load_config(args.model)
    print(f"threads: {numba.config.NUMBA_NUM_THREADS}")
    rows = attention_rows(f"bundled (H {cfg.num_heads}, Hkv {cfg.num_kv_heads}, hd {cfg.head_dim})",
                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.context, args.reps)
    rows += attention_rows("Mixtral (H 32, Hkv 8, hd 128)", 32, 8, 128, args.context, args.reps)
    print_table(rows, "KV cache: size and decode-step attention (one layer)")
    if args.skip_perplexity:
        return rows
    ppl_rows = []
    for experts in tqdm(["none", "int4"], desc="expert formats"):
        policy = parse_policy("none") if experts == "none" else parse_policy("moqe", experts)
        base = None
        for pair in TYPES:
            model, tok = load_model(args.model, policy=policy, kv_cache=pair)
            ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))
            ids = ids[: args.max_tokens] if args.max_tokens else ids
            r = perplexity(model, ids, args.window, args.stride)
            base = base or r["perplexity"]
            ppl_rows.append({"experts": "f32" if experts == "none" else f"moqe {experts}", "cache K/V": "/".join(pair),
                             "perplexity": round(r["perplexity"], 3), "vs f32 cache": f"{100 * (r['perplexity'] / base - 1):+.2f} %",
                             "KV bytes/token (model)": KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 1, cfg.head_dim, pair).bytes_per_token})
    print_table(ppl_rows, f"held-out perplexity ({len(ids)} tokens, window {args.window}, stride {args.stride})")
    return rows + ppl_rows
