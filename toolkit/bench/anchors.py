"""``python -m toolkit.bench anchors``: the bundled model in our runtime beside mistral.rs (and llama.cpp when a
build is given), same prompt, same greedy tokens, same thread count, in one run.

Workload: BOS + ``--prompt-tokens`` (200) tokens of ``data/heldout.txt``, then ``--new-tokens`` (64) greedy
tokens (end-of-sequence ignored), the same KV cache type on every engine (``--kv-cache``: f32 for mistral.rs,
q8_0 or q4_0 for llama.cpp, whose llama-bench has no f32 cache; rows an engine cannot run say so). Weights:
  plain          full precision (f32) everywhere;
  moqe q4_0/q8_0 the routed experts only in q4_0 / q8_0 (MoQE), the router f32, attention's projections,
                 embeddings and head in the checkpoint's 16-bit type on both engines (ours: ``Runtime.dense``,
                 exact; the bundled model is f16), or f32 for an f32 checkpoint.
  (plain: llama.cpp's f32 file; ours holds its experts f32 and attention, embeddings, head 16-bit as above.)
Engines:
  ours           ``toolkit.load.load_model`` + ``generate_tokens``, numba backend, Numba and BLAS threads set
                 together; prefill = time to the first token, decode = the later tokens (median of ``--reps``).
  mistral.rs     the PyPI ``mistralrs`` 0.9.5 CPU wheel (optional extra ``anchors``), one subprocess per row
                 (``RAYON_NUM_THREADS`` = threads, ``MISTRALRS_CPU_KV_F32=1``); MoQE through a topology file
                 (``/block_sparse_moe\\.experts\\./:`` with ``isq: q4_0``), since the wheel cannot set the ISQ
                 organization from Python; rates from its own usage counters (median of ``--reps`` requests
                 after a warm-up request; prefix cache off).
  llama.cpp      only with ``--llama-cpp DIR`` (a llama.cpp source tree with built tools, or the folder holding
                 ``llama-bench``): the model converted by its ``convert_hf_to_gguf.py`` to f32, experts
                 quantized by ``llama-quantize`` with the format as the base type (``--pure``, router f32,
                 attention, embeddings and head as ours holds them), the output's tensor types read back and
                 refused unless every expert is in the format, attention in that type, nothing else
                 quantized; ``llama-bench -ctk f32 -ctv f32`` prefill ``-p N`` and decode ``-n 64`` at depth N. Nothing is built here.
Statistic: every engine's rate is the median over ``--reps`` runs of that run's rate (tokens over their time);
the runs are interleaved: ours, then each anchor's run of the same row, ``--reps`` times.
``ours / x`` is our rate over the anchor's, both from this run. ``--quick``: 32-token prompt, 8 new tokens,
1 thread, plain and q4_0, 1 rep (a smoke test).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .timing import conditions, peak_of, print_table, set_threads, thread_counts

ROOT = Path(__file__).resolve().parents[2]
MISTRALRS_VERSION = "0.9.5"
INSTALL_HINT = (f"mistral.rs rows skipped: the `mistralrs` package is not installed. Install the optional extra: "
                f"pip install -e '.[anchors]'  (mistralrs=={MISTRALRS_VERSION}, a CPU wheel)")
RESULT_TAG = "ANCHOR_RESULT "


# ---- our runtime ------------------------------------------------------------------------------------------
def prompt_ids(tok, n: int, text: str | None = None) -> tuple[list[int], str]:
    """(BOS + the first ``n`` tokens of ``text`` (default: the held-out text), the text of those n tokens)."""
    text = text if text is not None else (ROOT / "data" / "heldout.txt").read_text()
    body = tok.encode(text, add_bos=False)
    while len(body) < n:  # a short text repeats
        body = body + body
    body = body[:n]
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + body
    return ids, tok.decode(body, skip_special_tokens=False)


def time_generation(model, ids: list[int], new_tokens: int) -> dict:
    """One greedy generation (end-of-sequence ignored): prefill s (to the first token), decode s per token
    (the mean over the later tokens: the later tokens' time over their count, the statistic llama-bench and
    mistral.rs report for one run), the tokens."""
    from ..model import SamplingParams, generate_tokens

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    t0 = time.perf_counter()
    stamps, out = [], []
    for ev in generate_tokens(model, [list(ids)], params):
        stamps.append(time.perf_counter())
        out.append(ev.token)
    prefill = stamps[0] - t0
    steps = np.diff(stamps)
    return {"prefill_s": prefill, "decode_s": float(np.mean(steps)) if len(steps) else float("nan"),
            "tokens": out}


def measure_ours(model, ids: list[int], new_tokens: int, reps: int, between=None) -> dict:
    """Median over ``reps`` generations (after a short warm-up one) of each generation's prefill and decode rate;
    counts compilations that happened while timing (0 expected: the warm-up compiles). ``between(rep)`` runs
    after each generation, outside the timing: the anchors' own rep of the same row (interleaved runs)."""
    from ..warmup import compile_watch

    time_generation(model, ids[: min(len(ids), 8)], 2)  # compiles (or loads) whatever this shape needs
    runs = []
    for r in range(reps):
        with compile_watch() as cw:
            runs.append(time_generation(model, ids, new_tokens))
        runs[-1]["compiled"] = cw.count
        if between is not None:
            between(r)
    return {"prefill tok/s": statistics.median(len(ids) / r["prefill_s"] for r in runs),
            "decode tok/s": statistics.median(1.0 / r["decode_s"] for r in runs), "tokens": runs[-1]["tokens"],
            "compiled": sum(r["compiled"] for r in runs)}


# ---- mistral.rs (in a subprocess per row: its thread pool is sized once per process) ----------------------
def mistralrs_available() -> bool:
    return importlib.util.find_spec("mistralrs") is not None


def _mistralrs_worker(spec: dict) -> dict:
    """Runs inside the subprocess: load, warm up, time ``reps`` greedy completions."""
    from mistralrs import Architecture, CompletionRequest, Runner, Which

    with tempfile.TemporaryDirectory(prefix="moqe-anchor-") as d:
        topology = None
        if spec["isq"]:
            topology = str(Path(d) / "topology.yml")
            Path(topology).write_text(f"/block_sparse_moe\\.experts\\./:\n  isq: {spec['isq']}\n")
        t0 = time.perf_counter()
        runner = Runner(Which.Plain(model_id=spec["model"], arch=Architecture.Mixtral, topology=topology),
                        no_paged_attn=True, prefix_cache_n=0)
        load_s = time.perf_counter() - t0

    def ask(prompt, n):
        return runner.send_completion_request(CompletionRequest(
            prompt=prompt, model="default", max_tokens=n, temperature=0.0, top_k=1, ignore_eos=True))

    ask(spec["prompt"][:64], 4)  # warm-up
    runs = [ask(spec["prompt"], spec["new_tokens"]) for _ in range(spec["reps"])]
    u = [r.usage for r in runs]
    return {"load_s": load_s, "prompt_tokens": u[-1].prompt_tokens, "completion_tokens": u[-1].completion_tokens,
            "prefill tok/s": statistics.median(x.avg_prompt_tok_per_sec for x in u),
            "decode tok/s": statistics.median(x.avg_compl_tok_per_sec for x in u),
            "text": runs[-1].choices[0].text}


def run_mistralrs(model: str, isq: str | None, prompt: str, new_tokens: int, threads: int, reps: int,
                  timeout: float = 900) -> dict:
    """One mistral.rs row in a subprocess; returns its result or {'error': reason}."""
    spec = {"model": str(model), "isq": isq, "prompt": prompt, "new_tokens": new_tokens, "reps": reps}
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), MISTRALRS_CPU_KV_F32="1")
    cmd = [sys.executable, "-m", "toolkit.bench", "anchors", "--mistralrs-worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {p.returncode}: " + " | ".join(t[-200:] for t in tail)}


# ---- llama.cpp (a build given with --llama-cpp DIR; nothing is built here) ---------------------------------
class LlamaCpp:
    """The tools of a llama.cpp build: ``llama-bench`` and ``llama-quantize`` (in DIR, DIR/bin or
    DIR/build/bin) and ``convert_hf_to_gguf.py`` (in DIR or a folder above the binaries)."""

    def __init__(self, directory: str | Path):
        d = Path(directory).expanduser().resolve()
        self.dir = d
        bins = [d, d / "bin", d / "build" / "bin"]
        self.bench = next((b / "llama-bench" for b in bins if (b / "llama-bench").is_file()), None)
        self.quantize = next((b / "llama-quantize" for b in bins if (b / "llama-quantize").is_file()), None)
        above = [d, *d.parents][:4]
        self.converter = next((p / "convert_hf_to_gguf.py" for p in above if (p / "convert_hf_to_gguf.py").is_file()), None)

    def missing(self) -> str | None:
        gone = [n for n, v in (("llama-bench", self.bench), ("llama-quantize", self.quantize),
                               ("convert_hf_to_gguf.py", self.converter)) if v is None]
        return f"llama.cpp rows skipped: {', '.join(gone)} not found under {self.dir}" if gone else None

    def convert(self, model_dir: Path, out: Path, outtype: str = "f32", timeout: float = 1800) -> None:
        """HF checkpoint -> GGUF (``outtype`` f32 or f16). The bundled tokenizer is byte-level BPE identical to
        GPT-2's, whose pre-tokenizer hash the converter does not list: when the converter's own check refuses
        it, it is told 'gpt-2' (its code is not edited: patched in the process that runs it). Needs torch (the
        converter imports it; the ``test`` extra has it)."""
        code = ("import sys; sys.path.insert(0, {src!r}); sys.argv = {argv!r}\n"
                "import convert_hf_to_gguf as c\n"
                "mods = [c]\n"
                "try:\n"
                "    import conversion.base as b; mods.append(b)\n"
                "except ImportError:\n"
                "    pass\n"
                "def patch(cls):\n"
                "    if 'get_vocab_base_pre' in vars(cls):\n"
                "        orig = cls.get_vocab_base_pre\n"
                "        def pre(self, tokenizer, orig=orig):\n"
                "            try:\n"
                "                return orig(self, tokenizer)\n"
                "            except NotImplementedError:\n"
                "                return 'gpt-2'\n"
                "        cls.get_vocab_base_pre = pre\n"
                # without sentencepiece installed, the first vocab attempt fails on its import instead of on the
                # missing tokenizer.model (which sends the converter on to the BPE vocab): check the file first
                "    if '_create_vocab_sentencepiece' in vars(cls):\n"
                "        sp = cls._create_vocab_sentencepiece\n"
                "        def spv(self, sp=sp):\n"
                "            if not (self.dir_model / 'tokenizer.model').is_file():\n"
                "                raise FileNotFoundError(str(self.dir_model / 'tokenizer.model'))\n"
                "            return sp(self)\n"
                "        cls._create_vocab_sentencepiece = spv\n"
                "for m in mods:\n"
                "    for name in ('TextModel', 'Model'):\n"
                "        cls = getattr(m, name, None)\n"
                "        if cls is not None:\n"
                "            patch(cls)\n"
                "c.main()\n").format(src=str(self.converter.parent),
                                     argv=["convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype, "--outfile", str(out)])
        env = dict(os.environ)
        gguf_py = self.converter.parent / "gguf-py"
        if gguf_py.is_dir():
            env["PYTHONPATH"] = str(gguf_py) + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode != 0 or not out.is_file():
            raise RuntimeError("convert_hf_to_gguf.py failed: " + " | ".join(p.stderr.strip().splitlines()[-3:]))

    def quantize_experts(self, src: Path, out: Path, fmt: str, dense: str = "f32", timeout: float = 1800) -> dict:
        """Experts (``ffn_{gate,up,down}_exps``) in ``fmt``, attention's projections, embeddings and head in
        ``dense`` (f32, or f16 / bf16: the type our numba runtime holds them in for a 16-bit checkpoint,
        ``Runtime.dense``), the router f32 (ours too), norms as converted; returns the output's tensor types,
        read back and checked (:func:`check_experts`). The base type is ``fmt`` itself: with a base type of F32
        llama.cpp skips every ``--tensor-type`` pattern and writes the f32 file again (which is what this anchor
        measured before: "q4_0" rows with f32 experts)."""
        cmd = [str(self.quantize), "--pure", "--token-embedding-type", dense, "--output-tensor-type", dense,
               "--tensor-type", f"attn={dense}", "--tensor-type", "ffn_gate_inp=f32", str(src), str(out), fmt.upper()]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not out.is_file():
            raise RuntimeError("llama-quantize failed: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:]))
        return check_experts(out, fmt, dense)

    def bench_rates(self, gguf: Path, threads: int, prompt: int, new: int, reps: int, kv: str = "f32",
                    timeout: float = 1800) -> dict:
        """``llama-bench``: prefill tok/s of a ``prompt``-token batch, decode tok/s of ``new`` tokens after
        ``prompt`` tokens of context, each the median over ``reps`` runs of that run's rate (``samples_ts``),
        and its peak resident set (``peak GB``: ``timing.peak_of``); the thread count and KV type are read back;
        KV cache ``kv`` for keys and values (llama-bench's default is f16; it has no f32 cache, ours no f16: the
        types both have are q8_0 and q4_0)."""
        if kv not in LLAMA_BENCH_KV:
            raise RuntimeError(f"llama-bench has no {kv} KV cache (its -ctk takes {', '.join(LLAMA_BENCH_KV)}): "
                               f"run with --kv-cache q8_0 for the llama.cpp rows")

        peaks = []

        def one(args):
            cmd = [str(self.bench), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json",
                   "-ctk", kv, "-ctv", kv, *args]
            rc, out, err, peak = peak_of(cmd, timeout)
            if rc != 0:
                raise RuntimeError("llama-bench failed: " + " | ".join((err or out).strip().splitlines()[-3:]))
            r = json.loads(out)[0]
            if r.get("type_k", kv) != kv or r.get("type_v", kv) != kv:
                raise RuntimeError(f"llama-bench ran a {r.get('type_k')}/{r.get('type_v')} KV cache, not {kv}")
            if r.get("n_threads", threads) != threads:
                raise RuntimeError(f"llama-bench ran {r.get('n_threads')} threads, not {threads}")
            peaks.append(peak)
            return statistics.median(r.get("samples_ts") or [r["avg_ts"]])

        return {"prefill tok/s": one(["-p", str(prompt), "-n", "0"]),
                "decode tok/s": one(["-p", "0", "-n", str(new), "-d", str(prompt)]), "peak GB": max(peaks) / 1e9}


LLAMA_BENCH_KV = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")  # llama-bench's -ctk/-ctv
EXPERTS_RE = r"blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight"
UNQUANTIZED = ("F32", "F16", "BF16")


def gguf_types(path: Path) -> dict:
    """{tensor name: GGML type name} of a GGUF file, read back with gguf-py."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path), "r").tensors}


def check_experts(path: Path, fmt: str, dense: str | None = None) -> dict:
    """Refuse a llama.cpp file whose routed experts are not all ``fmt`` or whose other matrices are quantized
    (the anchor's row says "experts in fmt, the rest full precision"), or, with ``dense``, whose attention
    projections are not in that type (the one ours reads them in); -> the file's types counted."""
    import re

    types, want = gguf_types(path), fmt.upper()
    experts = {n: t for n, t in types.items() if re.fullmatch(EXPERTS_RE, n)}
    if not experts:
        raise RuntimeError(f"{path.name}: no routed expert tensors (ffn_*_exps) to check")
    wrong = {n: t for n, t in experts.items() if t != want}
    if wrong:
        n, t = next(iter(wrong.items()))
        raise RuntimeError(f"{path.name}: {len(wrong)} expert tensor(s) are not {want}, e.g. {n} is {t}: "
                           f"llama-quantize did not quantize the experts as asked")
    other = {n: t for n, t in types.items() if n not in experts and t not in UNQUANTIZED}
    if other:
        n, t = next(iter(other.items()))
        raise RuntimeError(f"{path.name}: {n} is {t}; only the routed experts should be quantized")
    attn = {n: t for n, t in types.items() if re.fullmatch(r"blk\.\d+\.attn_(q|k|v|output)\.weight", n)}
    off = {n: t for n, t in attn.items() if dense is not None and t != dense.upper()}
    if off:
        n, t = next(iter(off.items()))
        raise RuntimeError(f"{path.name}: {n} is {t}, not {dense.upper()} as ours holds attention")
    counts: dict = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return counts


def dense_type(model_dir: Path) -> str:
    """The type our numba runtime holds a checkpoint's attention projections, embeddings and head in: its own
    16-bit type ('f16' / 'bf16', ``Runtime.dense``: exact), else 'f32'; the anchor's file holds them the same."""
    from ..model import load_config
    from ..model.runtime import format16

    return format16(load_config(model_dir).torch_dtype) or "f32"


def llama_cpp_files(llama: LlamaCpp, model_dir: Path, formats: list[str], workdir: Path) -> dict:
    """'plain' or format -> (GGUF path, its tensor types counted) or the Exception that stopped it: the model
    converted to f32 by llama.cpp's converter, then its experts quantized for real and checked, attention,
    embeddings and head in the type ours holds them in (``dense_type``)."""
    f32 = workdir / "model-f32.gguf"
    try:
        llama.convert(model_dir, f32, "f32")
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {w: e for w in ["plain", *formats]}
    files: dict = {"plain": (f32, None)}
    for fmt in formats:
        try:
            out = workdir / f"model-experts-{fmt}.gguf"
            files[fmt] = (out, llama.quantize_experts(f32, out, fmt, dense_type(model_dir)))
        except Exception as e:  # noqa: BLE001
            files[fmt] = e
    return files


def _median_rates(samples: list[dict]) -> dict:
    if not samples:
        return {}
    if any("error" in x for x in samples):
        return next(x for x in samples if "error" in x)
    return {k: statistics.median(x[k] for x in samples) for k in ("prefill tok/s", "decode tok/s", "peak GB")
            if all(k in x for x in samples)}


# ---- the table ---------------------------------------------------------------------------------------------
def _row(threads, weights, engine, prompt, new, load_s, rates, ours=None, note=""):
    pre, dec = rates.get("prefill tok/s", float("nan")), rates.get("decode tok/s", float("nan"))
    r = {"threads": threads, "weights": weights, "engine": engine, "prompt": prompt, "new": new, "load s": load_s,
         "prefill tok/s": pre, "decode tok/s": dec,
         "ours / x prefill": (ours["prefill tok/s"] / pre) if ours and pre == pre and pre > 0 else None,
         "ours / x decode": (ours["decode tok/s"] / dec) if ours and dec == dec and dec > 0 else None,
         "note": note or rates.get("error", "")}
    return r


def run(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench anchors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prompt tokens after BOS")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--formats", default="q4_0,q8_0", help="MoQE expert formats beside plain f32")
    ap.add_argument("--threads", default=",".join(map(str, thread_counts())))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache", default="f32", choices=["f32", "q8_0", "q4_0"],
                    help="the KV cache of every engine (f32: ours and mistral.rs; llama-bench has none, so its rows "
                         "need q8_0 or q4_0, which mistral.rs lacks)")
    ap.add_argument("--no-mistralrs", action="store_true")
    ap.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp build (llama-bench, llama-quantize, convert_hf_to_gguf.py)")
    ap.add_argument("--quick", action="store_true", help="32-token prompt, 8 new tokens, 1 thread, plain + q4_0, 1 rep")
    ap.add_argument("--mistralrs-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mistralrs_worker:
        print(RESULT_TAG + json.dumps(_mistralrs_worker(json.loads(args.mistralrs_worker))), flush=True)
        return []
    if args.quick:  # tiny workload; options given explicitly are kept
        for k, v in {"prompt_tokens": 32, "new_tokens": 8, "threads": "1", "formats": "q4_0", "reps": 1}.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)

    from ..load import load_model
    from ..quant import parse_policy
    from ..warmup import warm

    threads = [int(t) for t in args.threads.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    configs = [("plain", None)] + [(f"moqe {f}", f) for f in formats]
    use_mrs = not args.no_mistralrs and mistralrs_available() and args.kv_cache == "f32"  # its CPU cache: f16 or f32
    print(conditions(threads), flush=True)
    if not args.no_mistralrs and not use_mrs:
        print(INSTALL_HINT if not mistralrs_available() else
              f"mistral.rs rows skipped: its CPU KV cache is f32 or f16, not {args.kv_cache} (run --kv-cache f32 for them)",
              flush=True)
    warm(formats=formats, kv_types=tuple(dict.fromkeys(("f32", args.kv_cache))))  # compiled (or loaded) before timing

    llama, llama_files = None, {}
    scratch = tempfile.TemporaryDirectory(prefix="moqe-anchor-gguf-")
    if args.llama_cpp:
        llama = LlamaCpp(args.llama_cpp)
        why = llama.missing()
        if why is None:
            llama_files = llama_cpp_files(llama, Path(args.model), formats, Path(scratch.name))
            for w, f in llama_files.items():
                print(f"llama.cpp {w}: " + (f"{f[0].name}, tensor types read back {f[1]}" if not isinstance(f, Exception)
                                            and f[1] else "f32 file" if not isinstance(f, Exception) else f"error: {f}"),
                      flush=True)
        else:
            print(why, flush=True)

    models = {}
    for label, fmt in configs:
        policy = parse_policy("moqe", fmt) if fmt else None
        set_threads(max(threads))
        t0 = time.perf_counter()
        models[label] = load_model(args.model, backend="numba", policy=policy, kv_cache=args.kv_cache)
        models[label] = (*models[label], time.perf_counter() - t0)

    rows = []
    for t in threads:
        for label, fmt in configs:
            model, tok, load_s = models[label]
            ids, text = prompt_ids(tok, args.prompt_tokens)
            f = llama_files.get(fmt or "plain")
            ll, mrs = [], []

            def between(rep, t=t, f=f, fmt=fmt, ids=ids, text=text):  # the anchors' rep of this row, between ours
                if use_mrs:
                    mrs.append(run_mistralrs(args.model, fmt, text, args.new_tokens, t, 1))
                if f is not None:
                    if isinstance(f, Exception):
                        ll.append({"error": str(f)[:300]})
                        return
                    try:
                        ll.append(llama.bench_rates(f[0], t, len(ids), args.new_tokens, reps=1, kv=args.kv_cache))
                    except Exception as e:  # noqa: BLE001 - reported in the table
                        ll.append({"error": str(e)[:300]})

            set_threads(t)
            ours = measure_ours(model, ids, args.new_tokens, args.reps, between)
            note = f"compiled {ours['compiled']} kernel(s) while timing" if ours["compiled"] else ""
            rows.append(_row(t, label, "ours (numba)", len(ids), args.new_tokens, load_s, ours, note=note))
            if use_mrs:
                m = _median_rates(mrs)
                last = mrs[-1] if mrs else {}
                note = m.get("error", "")
                if not note:
                    note = f"{last['completion_tokens']} tokens; " + _agreement(tok.decode(ours["tokens"]), last["text"])
                rows.append(_row(t, label, f"mistral.rs {MISTRALRS_VERSION}", last.get("prompt_tokens", "-"),
                                 args.new_tokens, last.get("load_s", float("nan")), m, ours, note))
            if f is not None:
                rates = _median_rates(ll)
                types = "" if isinstance(f, Exception) or not f[1] else \
                    "types read back: " + ", ".join(f"{n} {k}" for k, n in sorted(f[1].items()))
                rows.append(_row(t, label, "llama.cpp", len(ids), args.new_tokens, None, rates, ours,
                                 "; ".join(x for x in (rates.get("error", ""), types) if x)))
    scratch.cleanup()
    print_table(rows, f"anchors: {Path(args.model).name}, BOS + {args.prompt_tokens} prompt tokens then "
                      f"{args.new_tokens} greedy tokens, {args.kv_cache} KV cache on every engine; each rate the median over "
                      f"{args.reps} runs of that run's rate, the engines' runs interleaved")
    print(conditions(threads) + " (after)", flush=True)
    return rows


def _agreement(ours: str, theirs: str) -> str:
    """Whether the anchor's greedy text is ours (the same weights, the same greedy rule)."""
    if ours == theirs:
        return "same greedy text as ours"
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"greedy text = ours for the first {n} of {len(ours)} characters"


if __name__ == "__main__":
    run()
