"""Loaded (and quantized) models, LRU-cached by (source, policy); the lock that serialises compute.

The KV cache type only changes how ``new_cache`` allocates, so one cached set of weights serves every KV
type: ``view`` returns a shallow copy with its own ``kv_types``. Numba's default (workqueue) threading
layer must not run parallel kernels from two threads at once, so all model work holds ``COMPUTE``;
generation takes it per token, so concurrent sessions interleave instead of waiting for each other.
"""
from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from toolkit.load import load_model
from toolkit.model.kv_cache import parse_kv_cache
from toolkit.quant import QuantReport
from toolkit.uqff import is_bundle

from .configs import Config, InputError

COMPUTE = threading.RLock()


@dataclass
class Loaded:
    model: object  # MoEModel
    tokenizer: object
    report: QuantReport
    load_s: float

    @property
    def weight_bytes(self) -> int:
        wb = self.model.weight_bytes()
        return wb["experts"] + wb["attention"] + wb["other"]  # ("host experts" is a part of "experts")

    @property
    def bits_per_weight(self) -> float:
        rows = self.report.rows
        params = sum(_numel(r["shape"]) for r in rows)
        return 8 * sum(r["bytes"] for r in rows) / params if params else 32.0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class ModelCache:
    """At most ``capacity`` models held; the least recently used is dropped first."""

    def __init__(self, capacity: int = 4, backend: str = "numba", activations: str | None = None):
        if capacity < 1:
            raise ValueError("the model cache needs room for at least one model")
        self.capacity, self.backend, self.activations = capacity, backend, activations
        self._items: OrderedDict[tuple, Loaded] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def keys(self) -> list[tuple]:
        with self._lock:
            return list(self._items)

    def get(self, source, cfg: Config) -> tuple[Loaded, bool]:
        """-> (Loaded for ``cfg`` on ``source``, whether it came from the cache)."""
        source = Path(source).resolve()
        bundle = is_bundle(source)
        if bundle and cfg.fmt != "none":
            raise InputError(f"{source.name} is a UQFF bundle, already quantized; choose expert format 'none' "
                             f"to run it as written (a bundle is never requantized)")
        policy = cfg.quant_policy
        key = (str(source), policy.label if policy else "none")
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key], True
        with COMPUTE:  # loads quantize with parallel kernels; also keeps two sessions from loading one key twice
            with self._lock:
                if key in self._items:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return self._items[key], True
            loaded = load(source, None if bundle else policy, self.backend, self.activations)
        with self._lock:
            self.misses += 1
            self._items[key] = loaded
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return loaded, False


def load(source, policy, backend: str, activations: str | None = None) -> Loaded:
    """``source`` loaded (and quantized with ``policy``, None: as stored), outside any cache; the caller holds
    ``COMPUTE``."""
    report = QuantReport(policy.label if policy else "none")
    t0 = time.perf_counter()
    model, tok = load_model(source, backend=backend, policy=policy, report=report, activations=activations)
    # the compiled decode step only once it is compiled (the warm-up compiles it last, app/kernels.py): a first
    # request never waits seconds for it to save milliseconds
    model.compiled_decode = "cached"
    return Loaded(model, tok, report, time.perf_counter() - t0)


def view(loaded: Loaded, kv: str):
    """The cached model with its own KV cache type (weights shared)."""
    m = copy.copy(loaded.model)
    m.kv_types = parse_kv_cache(kv)
    return m
