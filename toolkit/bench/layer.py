"""``python -m toolkit.bench layer``: real-shaped MoE layers through the whole runtime, per expert format and
thread count, beside llama.cpp on the same weights and the fp32-BLAS ceiling measured in the same run.

The model (``--shape``): Mixtral 8x7B's layer (hidden 4096, 8 experts of 14336, top-2, 32 query / 8 KV heads of
128), or Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, top-8, 32 / 4 heads of 128, q/k norms per head);
``--layers`` of them (default 1; Qwen3-30B-A3B has 48, Mixtral 32: the per-layer figures scale), vocab 8192 (the
bundled tokenizer), random fp16 weights (std 0.02, norms 1), written once to a checkpoint (``config.json`` +
``model.safetensors`` + tokenizer) tensor by tensor, so no more than one matrix is ever held in memory;
``--checkpoint DIR`` keeps it there (and reuses it, and llama.cpp's GGUFs made from it, when present).

Each (format, ``--activations`` kind)'s rows are measured in a fresh process on one load made for that kind
(``peak RSS GB``: the process's peak resident set when the row finished, the load included). Per format (``--formats``, default q4_0,q8_0,int4-g128) and thread count (``--threads``, default
1 and all; Numba and BLAS threads set together), through ``load_model``: ``--source checkpoint`` (default) loads
the fp16 checkpoint with policy moqe (experts quantized while it streams in; attention, embeddings and head
held in f16, exact; the router f32); ``--source gguf`` loads llama.cpp's own GGUF for the formats it has (the file its rows run):
  load s         load_model, reading (and quantizing) and packing included (kernels compiled before, by a warm-up);
  prefill tok/s  BOS + 63 tokens (``--prompt-tokens`` 64 in all): time to the first greedy token;
  decode tok/s   ``--new-tokens`` (16) greedy tokens after it (their mean; the median over ``--reps`` runs);
  ceiling tok/s  the fp32-BLAS ceiling of that prefill's expert GEMMs: f32 NumPy matmul on the same per-expert
                 shapes (gate_up [2I, D] and down [D, I] for each expert's share of the prompt's tokens x top-k,
                 one dense expert reused) for the work the prefill does: every token through the FFN of all
                 layers but the last, the last token only through the last layer's (both engines prune the last
                 layer: no other row reaches a logit), as prompt tokens per second; ``of ceiling`` = prefill /
                 ceiling. With ``--layers 1`` the prefill is mostly attention: its ceiling is far away.
With ``--llama-cpp DIR`` (a llama.cpp build; nothing is built here), the same checkpoint converted by its
``convert_hf_to_gguf.py`` and the experts quantized by ``llama-quantize`` for real (the format as base type,
attention, embeddings and head f16 as ours holds them, the router f32; the tensor types read back and checked) gives llama.cpp's prefill, decode and peak resident
set (``llama-bench -ctk K -ctv K`` with ``--kv-cache K``, ours the same: q8_0 or q4_0; its thread count read back)
for the formats it has (q4_0, q8_0, q4_k), one llama-bench run after each of ours (interleaved), both the median
over ``--reps`` runs of each run's rate.
``--quick``: the same family, tiny (hidden 256, 8 heads of 32; Mixtral: 8 experts of 512, Qwen3: 16 of 128, top-4),
16-token prompt, 4 new tokens, q4_0, 1 thread.
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..cpu.moe_gemm import parse_activations
from .anchors import LlamaCpp, _median_rates, measure_ours, prompt_ids
from .timing import conditions, median_seconds, print_table, set_threads, thread_counts

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
QUICK = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
# Qwen3-30B-A3B's exact layer (its config.json): 128 experts of 768, top-8, 32 / 4 heads of 128, q/k norms per head
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
QUICK_QWEN3 = dict(QUICK, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
SHAPES = {"mixtral": MIXTRAL, "qwen3-30b-a3b": QWEN3_30B_A3B}
QUICK_SHAPES = {"mixtral": QUICK, "qwen3-30b-a3b": QUICK_QWEN3}  # --quick: the same family, tiny
LLAMA_TYPES = {"q4_0": "q4_0", "q8_0": "q8_0", "q4_k": "q4_K"}  # ours -> llama.cpp's type (same blocks, byte for byte)


def layer_config(shape: dict, layers: int = 1, vocab: int = 8192) -> dict:
    """config.json of ``layers`` layers of ``shape``: Mixtral's family, or Qwen3-MoE's when it names ``num_experts``
    (vocab 8192 by default: the bundled tokenizer's; a real vocabulary, e.g. Mixtral's 32000, only changes the
    embeddings and head: the tokenizer's ids stay below 8192)."""
    common = dict(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096, rope_theta=1e6,
                  hidden_act="silu", tie_word_embeddings=False, torch_dtype="float16", bos_token_id=1, eos_token_id=2)
    if "num_experts" in shape:
        return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", rms_norm_eps=1e-6,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
                    **common, **shape)
    return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                rms_norm_eps=1e-5, **common, **shape)


def moe_dims(cfg: dict) -> tuple[int, int, int]:
    """(experts, expert intermediate size, top-k) of a config :func:`layer_config` wrote."""
    if "num_experts" in cfg:
        return cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    return cfg["num_local_experts"], cfg["intermediate_size"], cfg["num_experts_per_tok"]


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple]]:
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qwen = "num_experts" in cfg
    E, I, _ = moe_dims(cfg)
    moe, (g, u, d) = ("mlp", ("gate_proj", "up_proj", "down_proj")) if qwen else ("block_sparse_moe", ("w1", "w3", "w2"))
    out = [("model.embed_tokens.weight", (V, D))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (D,)),
                (f"{p}.self_attn.q_proj.weight", (H * hd, D)), (f"{p}.self_attn.k_proj.weight", (Hkv * hd, D)),
                (f"{p}.self_attn.v_proj.weight", (Hkv * hd, D)), (f"{p}.self_attn.o_proj.weight", (D, H * hd))]
        if qwen:
            out += [(f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,))]
        out += [(f"{p}.post_attention_layernorm.weight", (D,)), (f"{p}.{moe}.gate.weight", (E, D))]
        for e in range(E):
            ex = f"{p}.{moe}.experts.{e}"
            out += [(f"{ex}.{g}.weight", (I, D)), (f"{ex}.{u}.weight", (I, D)), (f"{ex}.{d}.weight", (D, I))]
    return out + [("model.norm.weight", (D,)), ("lm_head.weight", (V, D))]


def write_checkpoint(directory: Path, cfg: dict, seed: int = 0, pool: int = 0) -> None:
    """A safetensors checkpoint of random fp16 weights, written tensor by tensor (rows in blocks): the header
    first (every offset is known from the shapes), then each tensor as it is generated. ``pool`` > 0: every block
    is a window, at a random offset, of one pool of that many random values made once (a speed bench's weights at
    disk speed: a Mixtral layer's 2.9 GB in seconds, where drawing each value is ~10 ns)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    if pool:
        pooled = (rng.standard_normal(pool, dtype=np.float32) * np.float32(0.02)).astype(np.float16)
        pooled = np.concatenate([pooled, pooled])  # a window of up to ``pool`` values at any offset
    shapes = tensor_shapes(cfg)
    header, off = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt", "producer": "toolkit.bench.layer (random weights)"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = directory / "model.safetensors.partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape in shapes:
            if len(shape) == 1:  # norms
                f.write(np.ones(shape, np.float16).tobytes())
                continue
            rows = max(1, min(1 << 24, pool or 1 << 24) // shape[1])  # 64 MB of f32 at a time
            for r0 in range(0, shape[0], rows):
                if pool:
                    n, off = min(rows, shape[0] - r0) * shape[1], int(rng.integers(0, pool))
                    f.write(pooled[off:off + n].tobytes())
                    continue
                block = rng.standard_normal((min(rows, shape[0] - r0), shape[1]), dtype=np.float32)
                block *= np.float32(0.02)
                f.write(block.astype(np.float16).tobytes())
    tmp.replace(directory / "model.safetensors")
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "data" / "model" / fname, directory / fname)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))


@contextmanager
def checkpoint(cfg: dict, keep: str | None):
    """The checkpoint folder: ``keep`` (written unless it already holds this config) or a temporary one."""
    if keep:
        d = Path(keep)
        same = (d / "config.json").is_file() and json.loads((d / "config.json").read_text()) == cfg \
            and (d / "model.safetensors").is_file()
        if not same:
            write_checkpoint(d, cfg)
        yield d, not same
        return
    with tempfile.TemporaryDirectory(prefix="moqe-layer-") as t:
        write_checkpoint(Path(t), cfg)
        yield Path(t), True


def expert_counts(tokens: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Tokens per expert of a random top-k routing of ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)])
    return np.bincount(ids.reshape(-1), minlength=experts)


def blas_ceiling(cfg: dict, tokens: int, threads: list[int], reps: int) -> dict[int, dict]:
    """threads -> {'tok/s', 'GFLOP/s'}: f32 NumPy matmul on the per-expert GEMMs of a ``tokens``-token prefill:
    ``tokens`` rows through each of the first L - 1 layers' experts, one row through the last layer's top-k."""
    D, (E, I, k) = cfg["hidden_size"], moe_dims(cfg)
    L = cfg["num_hidden_layers"]
    counts = expert_counts(tokens, E, k)
    last = np.ones(k, np.int64)  # the last layer: the last token's k experts, one row each
    rng = np.random.default_rng(1)
    wgu = rng.standard_normal((2 * I, D), dtype=np.float32) * np.float32(0.02)
    wdn = rng.standard_normal((D, I), dtype=np.float32) * np.float32(0.02)
    x = rng.standard_normal((int(counts.max()), D), dtype=np.float32)
    flops = 2.0 * ((L - 1) * int(counts.sum()) + k) * (2 * I * D + D * I)

    def gemms():
        for layer in range(L):
            for n in (counts if layer < L - 1 else last):
                if n:
                    h = x[:n] @ wgu.T  # [n, 2I]
                    h[:, :I] @ wdn.T  # [n, D]: the activation's shape (silu excluded: GEMM FLOPs only)

    out = {}
    for t in threads:
        set_threads(t)
        s = median_seconds(gemms, reps=reps, warmup=1)
        out[t] = {"tok/s": tokens / s, "GFLOP/s": flops / s / 1e9}
    return out


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench layer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mixtral", choices=list(SHAPES),
                    help="the layer's shape: Mixtral 8x7B's (default) or Qwen3-30B-A3B's")
    ap.add_argument("--layers", type=int, default=1, help="layers of that shape (the per-layer figures scale)")
    ap.add_argument("--formats", default="q4_0,q8_0,int4-g128")
    ap.add_argument("--threads", default=",".join(map(str, thread_counts())))
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length, BOS included")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1, help="generations per row (median)")
    ap.add_argument("--kv-cache", default="f32", choices=["f32", "q8_0", "q4_0"],
                    help="the KV cache on both sides (llama-bench has no f32 cache: its rows need q8_0 or q4_0)")
    ap.add_argument("--activations", default="f32,int8", help="f32 and/or int8 (moqe --activations int8)")
    ap.add_argument("--source", default="checkpoint", choices=["checkpoint", "gguf"],
                    help="what ours loads: the fp16 checkpoint, quantized at load (default), or, for the formats "
                         "llama.cpp has, llama.cpp's own GGUF (the same file as its rows; needs --llama-cpp)")
    ap.add_argument("--checkpoint", metavar="DIR", help="write the checkpoint here and keep it (reused when present)")
    ap.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp build (llama-bench, llama-quantize, convert_hf_to_gguf.py)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 16-token prompt, 4 new tokens, q4_0, 1 thread")
    ap.add_argument("--vocab", type=int, default=8192,
                    help="the checkpoint's vocabulary (embeddings and head rows; Mixtral's is 32000, Qwen3's 151936)")
    ap.add_argument("--write-only", action="store_true", help="write the checkpoint (--checkpoint DIR) and stop")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.quick:  # tiny shapes and workload; options given explicitly are kept
        shape = QUICK_SHAPES[args.shape]
        for k, v in {"prompt_tokens": 16, "new_tokens": 4, "threads": "1", "formats": "q4_0"}.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.source == "gguf" and not args.llama_cpp:
        ap.error("--source gguf needs --llama-cpp (the GGUF files are llama.cpp's)")
    if args.vocab < 8192:
        ap.error(f"--vocab {args.vocab}: at least 8192 (the bundled tokenizer's ids)")
    cfg = layer_config(shape, args.layers, args.vocab)
    if args.write_only:
        if not args.checkpoint:
            ap.error("--write-only needs --checkpoint DIR")
        with checkpoint(cfg, args.checkpoint) as (ckpt, written):
            print(f"checkpoint {ckpt} ({(ckpt / 'model.safetensors').stat().st_size / 1e9:.2f} GB fp16, "
                  f"{'written' if written else 'already there'})")
        return []

    from ..warmup import warm

    threads = [int(t) for t in args.threads.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    print(conditions(threads), flush=True)
    try:
        acts = parse_activations(args.activations)
    except ValueError as e:
        ap.error(str(e))
    # compiled (or loaded) before timing, for the kernels each activation kind runs
    warm(formats=formats, kv_types=tuple(dict.fromkeys(("f32", args.kv_cache))), activations=acts)

    rows = []
    with checkpoint(cfg, args.checkpoint) as (ckpt, written):
        size = (ckpt / "model.safetensors").stat().st_size
        print(f"checkpoint {ckpt} ({size / 1e9:.2f} GB fp16, {'written' if written else 'reused'})", flush=True)
        scratch = tempfile.TemporaryDirectory(prefix="moqe-layer-gguf-")
        gguf_dir = ckpt if args.checkpoint else Path(scratch.name)  # kept beside a kept checkpoint, and reused
        llama_files = _llama(args, ckpt, formats, gguf_dir, reuse=not written) if args.llama_cpp else {}
        ceiling = blas_ceiling(cfg, args.prompt_tokens, threads, reps=3)
        for fmt in formats:  # each (format, activations) in a fresh process: its peak resident set is its own
            f = llama_files.get(fmt)
            src = str(f[0]) if args.source == "gguf" and isinstance(f, tuple) else str(ckpt)
            for act in acts:
                rows += _in_child(_format_rows, vars(args), fmt, act, src, threads, f, ceiling)
        scratch.cleanup()
    D, (E, I, k) = cfg["hidden_size"], moe_dims(cfg)
    print_table(rows, f"layer: {args.layers} {args.shape}-shaped layer(s) (hidden {D}, {E} experts of {I}, top-{k}, "
                      f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads of {cfg['head_dim']}, vocab {args.vocab}, "
                      f"random fp16), moqe from the {args.source}, {args.prompt_tokens}-token prompt then "
                      f"{args.new_tokens} greedy tokens, KV cache {args.kv_cache}")
    print("fp32 BLAS ceiling (same per-expert GEMMs, f32 NumPy matmul): " + ", ".join(
        f"{t} thread(s) {c['GFLOP/s']:.1f} GFLOP/s = {c['tok/s']:.1f} tok/s" for t, c in ceiling.items()))
    print(conditions(threads) + " (after)", flush=True)
    return rows


def _in_child(fn, *a):
    """``fn(*a)`` in a fresh spawned process (its own peak resident set, its own Numba thread pool)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *a).result()


def _format_rows(args: dict, fmt: str, act: str, src: str, threads: list[int], llama_file, ceiling: dict) -> list[dict]:
    """One (format, activation kind)'s rows, every thread count, measured in this (fresh) process on one load made
    for that kind (the load packs the experts for the kernels that run), llama.cpp's runs interleaved with ours;
    each row's ``peak RSS GB`` is this process's peak when the row finished (the load included)."""
    import json

    from ..load import load_model
    from ..mapped import resident
    from ..quant import parse_policy

    rows = []
    llama = LlamaCpp(args["llama_cpp"]) if args["llama_cpp"] and isinstance(llama_file, tuple) else None
    policy = None if src.endswith(".gguf") else parse_policy("moqe", fmt)
    t0 = time.perf_counter()
    model, tok = load_model(src, backend="numba", policy=policy, kv_cache=args["kv_cache"], activations=act)
    load_s = time.perf_counter() - t0
    ids, _ = prompt_ids(tok, args["prompt_tokens"] - (tok.bos_token_id is not None))
    for t in threads:
        set_threads(t)
        samples: list = []

        def between(rep, t=t, samples=samples, n=len(ids)):  # llama.cpp's run, between ours
            if llama is None:
                return
            try:
                samples.append(llama.bench_rates(llama_file[0], t, n, args["new_tokens"], reps=1, kv=args["kv_cache"]))
            except Exception as e:  # noqa: BLE001 - reported in the table
                samples.append({"error": str(e)[:300]})

        ours = measure_ours(model, ids, args["new_tokens"], args["reps"], between)
        ll = _median_rates(samples) if llama is not None else (
            {"error": f"llama.cpp: {llama_file}"} if isinstance(llama_file, Exception) else {})
        rows.append(_row(fmt, act, t, load_s, ids, ours, ceiling, ll, args["llama_cpp"]))
        rows[-1]["peak RSS GB"] = resident()["peak"] / 1e9
        print(json.dumps(rows[-1]), flush=True)  # as measured: a run cut short keeps what it had
    return rows


def _row(fmt, act, t, load_s, ids, ours, ceiling, ll, llama_cpp) -> dict:
    return {"experts": fmt, "activations": act, "threads": t, "load s": load_s, "prompt": len(ids),
            "prefill tok/s": ours["prefill tok/s"], "decode tok/s": ours["decode tok/s"],
            "decode ms/token": 1e3 / ours["decode tok/s"],
            "fp32 BLAS ceiling tok/s": ceiling[t]["tok/s"],
            "of ceiling": ours["prefill tok/s"] / ceiling[t]["tok/s"],
            **({"llama.cpp prefill": ll.get("prefill tok/s"), "llama.cpp decode": ll.get("decode tok/s"),
                "llama.cpp peak RSS GB": ll.get("peak GB")} if llama_cpp else {}),
            "note": (f"compiled {ours['compiled']} kernel(s) while timing" if ours["compiled"] else "")
            + ll.get("error", "")}


def _llama(args, ckpt: Path, formats: list[str], workdir: Path, reuse: bool = False) -> dict:
    """{format: (GGUF path, tensor types read back) or the Exception} for the formats llama.cpp has: the
    checkpoint converted to f16, its experts quantized for real and checked (with ``reuse``, a file already
    there from this checkpoint is checked and kept)."""
    from .anchors import check_experts, dense_type

    dense = dense_type(ckpt)  # f16: the checkpoint's type, in which ours holds attention, embeddings and head

    llama = LlamaCpp(args.llama_cpp)
    why = llama.missing()
    if why:
        print(why, flush=True)
        return {}
    todo = [f for f in formats if f in LLAMA_TYPES]
    out: dict = {}
    for fmt in list(todo):
        gguf = workdir / f"layer-{fmt}.gguf"
        if reuse and gguf.is_file():
            try:
                out[fmt] = (gguf, check_experts(gguf, LLAMA_TYPES[fmt], dense))
                todo.remove(fmt)
                print(f"llama.cpp {fmt}: {gguf} reused, tensor types read back {out[fmt][1]}", flush=True)
            except Exception:  # noqa: BLE001 - made again below
                pass
    if not todo:
        return out
    src = workdir / "layer-f16.gguf"
    try:
        llama.convert(ckpt, src, "f16")
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {**out, **{f: e for f in todo}}
    for fmt in todo:
        gguf = workdir / f"layer-{fmt}.gguf"
        try:
            out[fmt] = (gguf, llama.quantize_experts(src, gguf, LLAMA_TYPES[fmt], dense))
            print(f"llama.cpp {fmt}: {gguf.name}, tensor types read back {out[fmt][1]}", flush=True)
        except Exception as e:  # noqa: BLE001
            out[fmt] = e
    src.unlink(missing_ok=True)
    return out
