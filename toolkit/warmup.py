"""Compile (or load from Numba's disk cache) every kernel a configuration uses, before it is timed or served.

``warm(formats, kv_types)`` runs a tiny synthetic Mixtral-shaped model through the real load and forward
paths (quantize -> prefill long enough for the tiled path -> decode, each with the serial and the parallel
build of every kernel), once per expert format and KV cache type, so that the argument types are exactly
those of a real model; then the compiled one-token decode step of every (expert format, KV cache type) pair,
the path ``moqe generate`` takes by default. Warm, each step only loads machine code from the cache (well under a second);
cold, it compiles. ``moqe warmup``, ``python -m app`` and ``.ci/test`` call it; ``compile_watch`` tells the
CLI when compilation happens, so that printed rates can leave it out.

Shape of the synthetic model: hidden 256, 8 heads of 32 (2 KV heads), 4 experts of 256, top-2, vocab 64:
every group size (32, 64, 128) and GGML block (32, and the k-quants' 256) divides every dimension.
``FAMILIES_ALL`` (the default, and what the app offers) leaves out GGML's q4_1 / q5_* / k-quants (``offered=False``):
``moqe warmup --experts q4_k`` compiles theirs on request.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .formats import FORMATS

FAMILIES_ALL = tuple(f.name for f in FORMATS.values() if f.quantized and f.cpu_decoder and f.offered)  # one
# kernel family each
GGML_ONLY = tuple(f.name for f in FORMATS.values() if f.quantized and f.cpu_decoder and not f.offered)  # on request
KV_ALL = tuple(f.name for f in FORMATS.values() if f.kv_row)
_CONFIG = dict(architectures=["MixtralForCausalLM"], vocab_size=64, hidden_size=256, intermediate_size=256,
               num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
               tie_word_embeddings=False, torch_dtype="float16")
POLICIES = ("moqe", "all-linear")  # all-linear's quantized attention adds one-token qlinear builds of its own
FEW = 4  # tokens: 2 rows per expert, as a decode step of a few sequences (the f32 experts' grouped GEMV)
PREFILL = 48  # tokens: 24 rows per expert on average, past moe_gemm's GEMV limit, so the tiled path runs too


# ---- compile accounting ------------------------------------------------------------------------------
class CompileWatch:
    """Counts Numba compilations (outermost only) and their seconds; ``on_first`` runs at the first one."""

    def __init__(self, on_first=None):
        self.count, self.seconds, self.on_first = 0, 0.0, on_first
        self._depth, self._t0 = 0, 0.0
        self._lock = threading.Lock()

    def on_start(self, event):
        with self._lock:
            if self._depth == 0:
                self._t0 = time.perf_counter()
                if self.count == 0 and self.on_first is not None:
                    self.on_first()
                self.count += 1
            self._depth += 1

    def on_end(self, event):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - self._t0


@contextlib.contextmanager
def compile_watch(on_first=None):
    """``with compile_watch(print_once) as w: ...`` -> ``w.count`` compilations taking ``w.seconds``: Numba's, and
    the CUDA emulator's g++ builds (``toolkit/gpu/emulate.py``), so that printed rates leave both out."""
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, e):
            watch.on_start(e)

        def on_end(self, e):
            watch.on_end(e)

    from .gpu import emulate

    watch = CompileWatch(on_first)
    listener = _Listener()
    event.register("numba:compile", listener)
    emulate.WATCHERS.append(watch)  # the CUDA emulator's g++ builds count too (--backend cuda-emu)
    try:
        yield watch
    finally:
        emulate.WATCHERS.remove(watch)
        event.unregister("numba:compile", listener)


# ---- the synthetic model -----------------------------------------------------------------------------
def _tensors(rng: np.random.Generator) -> dict:
    c = _CONFIG
    D, I, V, E, H, Hkv = (c[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_local_experts",
                                         "num_attention_heads", "num_key_value_heads"))
    hd = D // H
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float16)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    p = "model.layers.0"
    t |= {f"{p}.input_layernorm.weight": 1 + r(D), f"{p}.post_attention_layernorm.weight": 1 + r(D),
          f"{p}.self_attn.q_proj.weight": r(H * hd, D), f"{p}.self_attn.k_proj.weight": r(Hkv * hd, D),
          f"{p}.self_attn.v_proj.weight": r(Hkv * hd, D), f"{p}.self_attn.o_proj.weight": r(D, H * hd),
          f"{p}.block_sparse_moe.gate.weight": r(E, D)}
    for e in range(E):
        ex = f"{p}.block_sparse_moe.experts.{e}"
        t |= {f"{ex}.w1.weight": r(I, D), f"{ex}.w3.weight": r(I, D), f"{ex}.w2.weight": r(D, I)}
    return t


@contextlib.contextmanager
def synthetic_checkpoint():
    """A temporary fp16 checkpoint folder of the synthetic model (written as the real ones are read)."""
    import json
    import tempfile
    from pathlib import Path

    from .model.safetensors_io import save_file

    with tempfile.TemporaryDirectory(prefix="moqe-warmup-") as d:
        save_file(_tensors(np.random.default_rng(0)), Path(d) / "model.safetensors")
        (Path(d) / "config.json").write_text(json.dumps(_CONFIG))
        yield Path(d)


def _run(model, kv: str, rng, gate=contextlib.nullcontext) -> None:
    """Prefill PREFILL tokens, then one decode step, with each build of every kernel; ``gate()`` is entered
    around each forward pass (the app's: wait while a request is served, then hold its compute lock)."""
    from .cpu._jit import parallel_threshold

    m = __import__("copy").copy(model)
    m.kv_types = (kv, kv)
    ids = rng.integers(0, _CONFIG["vocab_size"], (1, PREFILL))
    for threshold in (1 << 62, 0):  # serial builds, then parallel builds
        # the staged decode stages, then the compiled decode step (runs use it from Numba's cache and never
        # compile it; a run falls back to the staged stages where it is not cached, or for big layers on threads)
        for mode in ("off", "on"):
            m.compiled_decode = mode
            cache = m.new_cache(1, PREFILL + FEW + 1)
            for x, last in ((ids, False), (ids[:, :FEW], True), (ids[:, :1], True)):  # every row's logits: the
                with gate(), parallel_threshold(threshold):  # (one) layer's FFN runs on all PREFILL rows; FEW
                    m.forward(x, cache, last_only=last)      # rows (a batch's decode step); one decode step


@dataclass
class Step:
    what: str
    seconds: float
    compiled: int  # kernels compiled (0: all loaded from the cache)


@dataclass
class Report:
    steps: list[Step] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def compiled(self) -> int:
        return sum(s.compiled for s in self.steps)


def step_line(label: str, seconds: float, compiled: int) -> str:
    """The terminal's line for one warm-up step (``moqe warmup`` and the app)."""
    how = f"compiled {compiled} kernel(s)" if compiled else "from the cache"
    return f"kernels: {label:<32s} {seconds:6.1f} s ({how})"


def warm_steps(formats, kv_types, policies, decode: bool = True) -> list[tuple[str, str]]:
    """The warm-up's steps in order, as picklable (kind, name) pairs: the core ops first (every later step
    uses them), then each KV cache type, then each policy x expert format, then the compiled one-token decode
    step of each expert format with each quantized KV cache type (one build per pair: what ``moqe generate
    --experts F --kv-cache K`` runs; the f32 cache's was built by the policy step)."""
    out = [("core", "f32")] + [("kv", kv) for kv in kv_types if kv != "f32"]
    specs = [spec for spec in formats if spec not in ("none", None)]
    out += [("policy", f"{preset}:{spec}") for preset in policies for spec in specs]
    if not decode:
        return out
    return out + [("decode", f"moqe:{spec}:{kv}") for spec in specs for kv in kv_types if kv != "f32"]


class Warmer:
    """Runs warm-up steps one at a time on one synthetic checkpoint: ``with Warmer() as w: w.step(("core", "f32"))``
    -> (label, seconds, kernels compiled). ``gate``: a context-manager factory entered around each forward pass
    (the app passes one that waits while a request is being served, then holds its compute lock), so a caller
    can interleave its own work between the passes. The models a step builds are kept for the later steps."""

    def __init__(self, backend: str = "numba", gate=None, seed: int = 1, activations: str | None = None):
        self.backend, self.gate, self.activations = backend, gate or contextlib.nullcontext, activations
        self.rng, self.models, self.dir = np.random.default_rng(seed), {}, None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Warmer":
        self.dir = self._stack.enter_context(synthetic_checkpoint())
        return self

    def __exit__(self, *exc) -> None:
        self.models.clear()
        self._stack.close()

    def step(self, step: tuple[str, str]) -> tuple[str, float, int]:
        t0 = time.perf_counter()
        with compile_watch() as w:
            label = self._do(step)
        return label, time.perf_counter() - t0, w.count

    def _model(self, key, policy):
        from .model import Checkpoint, MoEModel, load_config, load_weights
        from .model.runtime import Runtime
        from .quant import quantizing_transform

        from .cpu._jit import parallel_threshold

        if key not in self.models:
            cfg, ck = load_config(self.dir), Checkpoint(self.dir)
            def build():
                rt = Runtime(self.backend, self.activations)  # the weights prepared for the kind, as a load does
                weights = load_weights(ck, cfg, rt.placing(quantizing_transform(policy, self.backend), cfg))
                return MoEModel(cfg, weights, self.backend, activations=self.activations)

            # quantized and packed by the parallel builds first (the load's kernels pick a build by size, as the
            # forward's do), then as a run loads it: the model kept
            with self.gate(), parallel_threshold(0):
                build()
            with self.gate():
                self.models[key] = build()
        return self.models[key]

    def _do(self, step: tuple[str, str]) -> str:
        from .quant import Policy, parse_policy

        kind, name = step
        if kind in ("core", "kv"):
            _run(self._model("full", Policy()), name, self.rng, self.gate)
            return "core ops (f32 model, f32 KV)" if kind == "core" else f"KV cache {name}"
        if kind == "decode":  # the compiled decode step alone (the staged kernels came with the kv and policy steps)
            preset, spec, kv = name.split(":")
            m = __import__("copy").copy(self._model(("model", preset, spec), parse_policy(preset, spec)))
            m.kv_types, m.compiled_decode, m._steps = (kv, kv), "on", None
            ids = self.rng.integers(0, _CONFIG["vocab_size"], (1, 4))
            cache = m.new_cache(1, 5)
            for x in (ids, ids[:, :1]):
                with self.gate():
                    m.forward(x, cache, last_only=True)
            return f"decode step {spec} / {kv} cache"
        preset, spec = name.split(":", 1)
        policy = parse_policy(preset, spec)
        model = self._model(("policy", preset, spec), policy)
        self.models.pop(("policy", preset, spec))  # used once: not kept
        _run(model, "f32", self.rng, self.gate)
        return f"{policy.label} (quantize + GEMM)"


_WARMERS: dict = {}  # a worker process's Warmer per (backend, activation kind), made at its first step


def _worker_step(args) -> tuple[str, float, int]:
    """One step in a worker process (``warm(jobs=N)``) -> (label, seconds, kernels compiled). The process keeps a
    Warmer per activation kind across the steps it is handed (its models and synthetic checkpoint), closed when the
    process exits."""
    step, backend, activations = args
    w = _WARMERS.get((backend, activations))
    if w is None:
        from multiprocessing import util

        w = _WARMERS[(backend, activations)] = Warmer(backend, activations=activations).__enter__()
        util.Finalize(None, w.__exit__, args=(None, None, None), exitpriority=10)
    return w.step(step)


def warm(formats=FAMILIES_ALL, kv_types=KV_ALL, policies=None, backend: str = "numba", log=None, jobs: int = 1,
         decode: bool = True, activations=None) -> Report:
    """Compile or load every kernel that ``policies`` x ``formats`` x ``kv_types`` use on ``backend``, for each
    expert activation kind in ``activations`` (default: ``moe_gemm.DEFAULT_ACTIVATIONS``, what a load takes: the
    integer formats' kernels differ between int8 and f32);
    ``log(line)`` gets one line per kernel family. Returns what each step cost. ``decode=False`` leaves out the
    compiled decode steps of the (format, quantized KV cache) pairs (they then compile on first use, ~5-8 s
    each on 2 cores): the app, whose first request waits for its warm-up, takes that path.

    ``jobs > 1``: after the core step, the steps of every kind go to that many worker processes, each taking the
    next step when it finishes one (each compiles into the same Numba disk cache), then every step runs once more
    here, loading from the cache. That pass reports what it compiled: nothing, now that ``toolkit/numba_cache.py``
    locks the update of Numba's index (before, two processes saving entries of one function at the same instant
    could drop one of them)."""
    from .cpu.moe_gemm import check_activations

    acts = [check_activations(k) for k in (tuple(activations) if activations is not None else (None,))]
    report = Report()
    policies = POLICIES if policies is None else policies
    if backend != "numba":
        return report
    steps = warm_steps(formats, kv_types, policies, decode)
    # (kind, step): the first kind's core step runs first, here (every later step uses its kernels); each kind's steps
    # in warm_steps' order (the long policy steps before the short decode steps)
    tasks = [(act, st) for k, act in enumerate(acts) for st in (steps[1:] if k == 0 else steps)]

    def record(label, seconds, compiled, where=""):
        report.steps.append(Step(label, seconds, compiled))
        if log is not None:
            log(step_line(label, seconds, compiled) + where)

    with contextlib.ExitStack() as stack:
        warmers = {}

        def here(act) -> Warmer:
            if act not in warmers:
                warmers[act] = stack.enter_context(Warmer(backend, activations=act))
            return warmers[act]

        record(*here(acts[0]).step(steps[0]))
        if jobs > 1 and len(tasks) > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            # a worker that dies raises BrokenProcessPool here (a Pool would wait for it forever)
            with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=mp.get_context("spawn")) as pool:
                for fut in as_completed([pool.submit(_worker_step, (st, backend, act)) for act, st in tasks]):
                    record(*fut.result(), " [worker]")
            for act, st in tasks:  # loads what the workers compiled (toolkit/numba_cache.py keeps concurrent saves)
                record(*here(act).step(st), " [check]")
        else:
            for act, st in tasks:
                record(*here(act).step(st))
    return report
