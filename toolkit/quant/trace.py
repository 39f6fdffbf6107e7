"""Routing traces: how often each routed expert of each MoE layer is chosen on a text, which pairs are chosen
together, and how two models' routers agree on the same tokens (issue 33: the placement planner's input; the
router's fidelity under quantization beside KLD).

A trace of ``T`` tokens through a model whose MoE layers are ``layers`` (``L`` of them), ``E`` experts, top-``A``:
  ``counts [L, E]`` int64: tokens routed to each expert;
  ``pairs [L, E, E]`` int64: tokens routed to both e and f (symmetric; its diagonal is ``counts``);
  ``ids [L, T, A]`` int32, kept when asked (``keep_ids``): each token's chosen experts in the router's order.
Saved as safetensors (``layers.{i}.counts`` / ``.pairs`` / ``.ids``, the model's layer index ``i``), metadata
``writer``, ``kind: routing-trace``, ``tokens``, ``top_k``, ``experts``, ``source``; :func:`load` checks every
shape and value against that metadata and names what is wrong.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, ModelError

KIND = "routing-trace"
_NAME = re.compile(r"layers\.(\d+)\.(counts|pairs|ids)")


@dataclass
class Trace:
    layers: tuple  # the model's index of each MoE layer, ascending
    counts: np.ndarray  # [L, E] int64
    pairs: np.ndarray  # [L, E, E] int64
    tokens: int  # T
    top_k: int  # A
    ids: np.ndarray | None = None  # [L, T, A] int32
    source: str = ""

    @property
    def experts(self) -> int:
        return self.counts.shape[1]

    def shares(self) -> np.ndarray:
        """[L, E]: each expert's share of its layer's routed slots (a row sums to 1)."""
        return self.counts / max(1, self.tokens * self.top_k)

    def imbalance(self) -> np.ndarray:
        """[L]: the busiest expert's count over the mean count (1: perfectly even)."""
        return self.counts.max(axis=1) * self.experts / max(1, self.tokens * self.top_k)


def add_tokens(counts: np.ndarray, pairs: np.ndarray, ids: np.ndarray) -> None:
    """Count ``ids [T, A]`` (each token's distinct experts) into ``counts [E]`` and ``pairs [E, E]`` in place."""
    T, A = ids.shape
    E = counts.shape[0]
    np.add.at(counts, ids.reshape(-1), 1)
    flat = (ids[:, :, None] * E + ids[:, None, :]).reshape(-1)  # [T * A * A] every ordered pair, the diagonal too
    pairs += np.bincount(flat, minlength=E * E).reshape(E, E)


@contextlib.contextmanager
def watching_experts(model, see):
    """While inside, every MoE layer's experts call ``see(i, x, ids, weights)`` (``i`` the model's layer index; the
    experts' own inputs, on the backend) before they run; the hooks are removed on exit, an error included. The one
    hook the routing trace and the sensitivity measurement (``toolkit/quant/sensitivity.py``) both use. Yields the
    MoE layers' indices."""
    moe = [i for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "experts")]
    hooked = []
    try:
        for i in moe:
            ffn = model.layers[i].ffn
            inner = ffn.experts

            hooked.append((ffn, inner))
            ffn.experts = _Watched(inner, i, see)
        yield moe
    finally:
        for ffn, inner in hooked:
            ffn.experts = inner


class _Watched:
    """A layer's experts with ``see`` called before they run; every other attribute is the experts' own (their
    bytes, placement), so a model stays whole while watched."""

    def __init__(self, inner, i: int, see):
        self._inner, self._i, self._see = inner, i, see

    def __call__(self, x, ids, wts):
        self._see(self._i, x, ids, wts)
        return self._inner(x, ids, wts)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Recorder:
    """Counts every MoE layer's routing while installed (``with Recorder(model) as r: model.forward(...)``); its
    hooks are ``watching_experts``'s, removed on exit, an error included. ``r.trace()`` -> the :class:`Trace` of every token that went through."""

    def __init__(self, model, keep_ids: bool = False, source: str = ""):
        self.model, self.keep_ids, self.source = model, keep_ids, source
        self.moe = [i for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "experts")]
        if not self.moe:
            raise ModelError("the model has no routed-expert layer to trace")
        E = model.cfg.num_experts
        self.counts = np.zeros((len(self.moe), E), np.int64)  # [L, E]
        self.pairs = np.zeros((len(self.moe), E, E), np.int64)  # [L, E, E]
        self.kept: list[list] = [[] for _ in self.moe]
        self.tokens = 0

    def _see(self, i, x, ids_, wts) -> None:
        E, A = self.model.cfg.num_experts, self.model.cfg.top_k
        got = np.asarray(self.model.rt.host(ids_), np.int64)  # [T, A]
        if got.ndim != 2 or got.shape[1] != A or (got < 0).any() or (got >= E).any():
            raise ModelError(f"layer {i}: the router returned expert ids {got.shape} outside 0..{E - 1}")
        j = self.moe.index(i)
        add_tokens(self.counts[j], self.pairs[j], got)
        if j == 0:
            self.tokens += got.shape[0]
        if self.keep_ids:
            self.kept[j].append(got.astype(np.int32))

    def __enter__(self) -> "Recorder":
        self._watch = watching_experts(self.model, self._see)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._watch.__exit__(*exc)

    def trace(self) -> Trace:
        if self.tokens == 0:
            raise ModelError("no tokens went through the model's MoE layers")
        ids = np.stack([np.concatenate(k) for k in self.kept]) if self.keep_ids else None
        return Trace(tuple(self.moe), self.counts.copy(), self.pairs.copy(), self.tokens, self.model.cfg.top_k, ids,
                     self.source)


def record(model, ids, window: int = 256, keep_ids: bool = False, progress=None, source: str = "") -> Trace:
    """Run ``model`` over token ids ``ids`` in disjoint windows of ``window`` tokens (each from an empty cache) and
    count every MoE layer's routing; ``progress`` (a tqdm-like ``update(n)``) gets each window's tokens."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if len(ids) < 1:
        raise ModelError("no tokens to trace")
    with Recorder(model, keep_ids, source) as r:
        for begin in range(0, len(ids), window):
            chunk = ids[begin:begin + window]
            model.forward(chunk[None], model.new_cache(1, len(chunk)))
            if progress is not None:
                progress.update(len(chunk))
    return r.trace()


def fidelity(ref: Trace, got: Trace) -> list[dict]:
    """Per MoE layer, how ``got``'s router agrees with ``ref``'s on the same tokens (both recorded with
    ``keep_ids``): ``top-k overlap`` (the mean share of a token's A experts both chose) and ``flip rate`` (the share
    of tokens whose expert set differs)."""
    if ref.ids is None or got.ids is None:
        raise ModelError("router fidelity needs both traces recorded with their ids (keep_ids)")
    if ref.layers != got.layers or ref.ids.shape != got.ids.shape:
        raise ModelError(f"the traces differ in layers or tokens: {ref.layers} x {ref.ids.shape} against "
                         f"{got.layers} x {got.ids.shape}")
    rows = []
    for j, i in enumerate(ref.layers):
        a, b = np.sort(ref.ids[j], axis=1), np.sort(got.ids[j], axis=1)  # [T, A]
        same = (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)  # [T] experts both chose
        rows.append({"layer": i, "top-k overlap": float(same.mean() / ref.top_k),
                     "flip rate": float((same < ref.top_k).mean())})
    return rows


def save(path, trace: Trace) -> None:
    """Write ``trace`` to ``path`` (safetensors), atomically; the caller has checked the target (toolkit.writes)."""
    from ..model.safetensors_io import save_file
    from ..writes import WRITER

    t = {}
    for j, i in enumerate(trace.layers):
        t[f"layers.{i}.counts"] = trace.counts[j]
        t[f"layers.{i}.pairs"] = trace.pairs[j]
        if trace.ids is not None:
            t[f"layers.{i}.ids"] = trace.ids[j]
    save_file(t, path, metadata={"writer": WRITER, "kind": KIND, "tokens": str(trace.tokens),
                                 "top_k": str(trace.top_k), "experts": str(trace.experts), "source": trace.source})


def load(path) -> Trace:
    """The inverse of :func:`save`; refuses a file that is not a consistent routing trace, naming what is wrong."""
    from ..model.safetensors_io import SafeTensorsFile

    f = SafeTensorsFile(path)
    meta = f.metadata or {}

    def fail(msg):
        raise FormatError(f"{path}: {msg}")

    if meta.get("kind") != KIND:
        fail(f"not a routing trace (metadata kind {meta.get('kind')!r}, want {KIND!r})")
    try:
        T, A, E = (int(meta[k]) for k in ("tokens", "top_k", "experts"))
    except (KeyError, ValueError):
        fail("metadata needs integer 'tokens', 'top_k' and 'experts'")
    if T < 1 or not 1 <= A <= E:
        fail(f"tokens {T}, top_k {A}, experts {E}: need tokens >= 1 and 1 <= top_k <= experts")
    parts: dict[int, dict] = {}
    for name in f.keys():
        m = _NAME.fullmatch(name)
        if m is None:
            fail(f"unexpected tensor {name!r} (want layers.I.counts / .pairs / .ids)")
        parts.setdefault(int(m.group(1)), {})[m.group(2)] = np.asarray(f.get(name))
    if not parts:
        fail("holds no layer")
    layers = tuple(sorted(parts))
    with_ids = {"ids" in parts[i] for i in layers}
    if len(with_ids) != 1:
        fail("some layers hold ids and others do not")
    for i in layers:
        p = parts[i]
        c, q = p.get("counts"), p.get("pairs")
        if c is None or q is None:
            fail(f"layer {i}: needs both counts and pairs")
        if c.shape != (E,) or q.shape != (E, E) or c.dtype != np.int64 or q.dtype != np.int64:
            fail(f"layer {i}: counts {c.dtype} {c.shape} / pairs {q.dtype} {q.shape}, want int64 [{E}] / [{E}, {E}]")
        if (c < 0).any() or c.sum() != T * A or not np.array_equal(np.diagonal(q), c) or not np.array_equal(q, q.T):
            fail(f"layer {i}: counts must sum to tokens x top_k = {T * A}, and pairs be symmetric with counts on "
                 "its diagonal")
        if "ids" in p:
            d = p["ids"]
            if d.shape != (T, A) or d.dtype != np.int32 or (d < 0).any() or (d >= E).any():
                fail(f"layer {i}: ids {d.dtype} {d.shape}, want int32 [{T}, {A}] in 0..{E - 1}")
    ids = np.stack([parts[i]["ids"] for i in layers]) if with_ids == {True} else None
    return Trace(layers, np.stack([parts[i]["counts"] for i in layers]), np.stack([parts[i]["pairs"] for i in layers]),
                 T, A, ids, meta.get("source", ""))
