"""``python -m toolkit.bench.mixtral_decode``: decode tok/s of a Mixtral-shaped model on one GPU (gpu-check step 'decode').

Mixtral 8x7B's layer (hidden 4096, 32 / 8 heads of 128, 8 experts of 14336, top-2, vocab 32000), random fp16
weights written once as a checkpoint of 2 layers (``toolkit.bench.layer``, windows of one pool of random values:
disk speed), the 1-layer model its first layer (the same file, hard-linked, with a 1-layer config), each loaded as
a user loads one
(``load_model``: experts quantized to each ``--formats`` entry at load, attention f32 on the device, q8_0 KV
cache), then ``--tokens`` greedy tokens generated as ``moqe generate`` does, with the recorded decode step
replayed eagerly and as a CUDA graph. Per row: the median ms per token over the generated tokens (the first
one, which records the step, is in the spread, not the median).
Extrapolated rows: per layer = t(2 layers) - t(1 layer); 32 layers = t(1) + 31 * per layer (said so in the row);
a layer's bytes per token (attention f32 + the top-2 experts as stored) over the per-layer time, as GB/s and as a
fraction of this run's device copy ceiling (``--ceilings``, the TSV of ``toolkit.bench.ceilings``).
Every row is printed and appended to ``--rows`` as it is measured. ``--emulate``: cuda-emu, a tiny layer.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from ..formats import get_format
from .layer import MIXTRAL, QUICK, layer_config, write_checkpoint
from .seed_moe import read_ceilings
from .timing import RowStream

LAYERS = 32  # Mixtral 8x7B


def layer_bytes(cfg: dict, spec: str) -> int:
    """Bytes one decode token reads in one layer: attention's f32 projections and the top-k experts as stored."""
    D, I, H, Hkv, hd = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim"))
    attention = 4 * D * (2 * H * hd + 2 * Hkv * hd)
    return attention + cfg["num_experts_per_tok"] * 3 * get_format(spec).nbytes((I, D))


def median_ms_per_token(model, prompt: list[int], n: int) -> float:
    from ..model import SamplingParams, generate_tokens

    params = SamplingParams(max_new_tokens=n, stop_token_ids=())
    stamps = [time.perf_counter() for _ in generate_tokens(model, [prompt], params)]
    return float(np.median(np.diff(stamps))) * 1e3


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench.mixtral_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int4,fp8", help="expert formats (moqe policy)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per row")
    ap.add_argument("--ceilings", default=None, help="the ceilings TSV of this run (python -m toolkit.bench.ceilings)")
    ap.add_argument("--rows", default=None, help="append every row, as measured, to this TSV file")
    ap.add_argument("--emulate", action="store_true", help="cuda-emu on a tiny layer (no GPU)")
    args = ap.parse_args(argv)
    from ..load import load_model
    from ..quant import parse_policy

    backend, shape, vocab, n = ("cuda-emu", QUICK, 8192, 3) if args.emulate else ("cuda", MIXTRAL, 32000, args.tokens)
    if args.emulate:
        args.formats = args.formats.split(",")[0]
    copy = read_ceilings(args.ceilings).get(("copy",))
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, min(vocab, 8192), 16)]
    out = RowStream(f"decode of a {'tiny' if args.emulate else 'Mixtral-shaped'} model on {backend}: median ms per "
                    f"token over {n} greedy tokens, 16-token prompt, q8_0 KV cache; 32 layers extrapolated from 1 and 2",
                    args.rows)
    ms: dict = {}  # (format, graphs) -> {layers: ms}
    with tempfile.TemporaryDirectory(prefix="moqe-decode-") as tmp:
        dirs = {2: Path(tmp) / "two", 1: Path(tmp) / "one"}
        write_checkpoint(dirs[2], layer_config(shape, 2, vocab), pool=1 << 25)
        dirs[1].mkdir()
        for f in dirs[2].iterdir():  # layer 0 of the same file: the loader reads the tensors its config names
            if f.name != "config.json":
                os.link(f, dirs[1] / f.name)
        (dirs[1] / "config.json").write_text(json.dumps(layer_config(shape, 1, vocab), indent=1))
        for layers in (1, 2):
            for spec in args.formats.split(","):
                model, _ = load_model(dirs[layers], backend=backend, policy=parse_policy("moqe", spec), kv_cache="q8_0")
                for graphs in ((False, True) if backend == "cuda" else (False,)):
                    model.cuda_graphs = graphs
                    median_ms_per_token(model, prompt, 2)  # compiles what the first run builds
                    t = median_ms_per_token(model, prompt, n)
                    ms.setdefault((spec, graphs), {})[layers] = t
                    out.add({"layers": layers, "experts": spec, "cuda graph": "yes" if graphs else "no", "ms/token": t,
                             "tok/s": 1e3 / t, "per layer ms": "-", "layer GB/s": "-", "of copy": "-"})
                del model
    for (spec, graphs), t in ms.items():
        if 1 in t and 2 in t:
            per = t[2] - t[1]
            total = t[1] + (LAYERS - 1) * per
            gbs = layer_bytes(layer_config(shape, 1, vocab), spec) / (per * 1e-3) / 1e9 if per > 0 else None
            out.add({"layers": f"{LAYERS} (extrapolated)", "experts": spec, "cuda graph": "yes" if graphs else "no",
                     "ms/token": total, "tok/s": 1e3 / total, "per layer ms": per, "layer GB/s": gbs if gbs else "-",
                     "of copy": gbs / copy if gbs and copy else "-"})
    return out.rows


if __name__ == "__main__":
    run()
