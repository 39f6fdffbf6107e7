"""What one process of an expert-parallel run loads (issue 35): the routed experts it holds, by layer.

A driver holds every weight but the routed experts (``ExpertShard.driver``); an expert rank holds only its own
routed experts and nothing else (``ExpertShard.rank``). The loaders (checkpoint, UQFF bundle, GGUF) read a
process's share through ``Runtime.placing(..., shard=)``: a routed-expert weight is handed to the load's transform
as the stack of the shard's experts only (``subset_load``: ``[n, out, in]``, expert ``e`` of the stack being global
expert ``ids[e]``), so a quantizer, a bundle reader or a stored GGUF tensor never reads another rank's expert.

Shape legend: ``E`` routed experts per layer, ``n`` experts of the shard in a layer.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

from ..formats import QTensor
from ..formats.mixed import MixedExperts, group_experts

EXPERT_ROLES = frozenset({"moe.gate_up", "moe.down", "moe.gate_up_bias", "moe.down_bias"})


@dataclass(frozen=True)
class ExpertShard:
    """``ids[layer]``: the global ids (ascending) of the routed experts this process loads in that MoE layer;
    ``experts_only``: load nothing else (an expert rank)."""

    ids: dict = field(default_factory=dict)  # layer -> int64 [n]
    experts_only: bool = False
    total: int = 0  # E

    @classmethod
    def driver(cls, moe_layers, E: int) -> "ExpertShard":
        return cls({i: np.zeros(0, np.int64) for i in moe_layers}, False, E)

    @classmethod
    def rank(cls, ids: dict, E: int) -> "ExpertShard":
        return cls({i: np.asarray(v, np.int64) for i, v in ids.items()}, True, E)

    def layer(self, i) -> np.ndarray | None:
        """The global ids loaded in layer ``i``, or None when the shard says nothing of it (a dense layer)."""
        return self.ids.get(i) if i is not None else None

    def keeps(self, role: str, layer) -> bool:
        """Whether a weight of ``role`` is read at all by this process."""
        if role in EXPERT_ROLES:
            ids = self.layer(layer)
            return ids is None or ids.size > 0
        return not self.experts_only

    def select(self, a, layer):
        """A routed-expert weight the loader produced for every expert ``[E, ...]`` (a GGUF's expert biases,
        read directly) cut to the shard's ``[n, ...]``; one already cut, or of a layer the shard does not cut, as
        it is."""
        ids = self.layer(layer)
        if ids is None or a is None or a.shape[0] != self.total or ids.size == self.total:
            return a
        return take_experts(a, ids)


def take_experts(w, ids):
    """Experts ``ids`` of a stacked weight ``[E, ...]`` (ndarray, QTensor or MixedExperts) -> ``[n, ...]``, copying
    only those experts' rows (a mapped file's other pages are never read)."""
    ids = np.asarray(ids, np.int64)
    if isinstance(w, MixedExperts):
        return group_experts([w.expert(int(e)) for e in ids])
    if isinstance(w, QTensor):
        return QTensor(w.fmt, (len(ids),) + tuple(w.shape[1:]), {k: np.ascontiguousarray(a[ids]) for k, a in w.arrays.items()})
    return np.ascontiguousarray(np.asarray(w)[ids])


def _per_expert(load) -> bool:
    try:
        return len(inspect.signature(load).parameters) > 0
    except (TypeError, ValueError):
        return False


def subset_load(load, ids, E: int):
    """A stacked expert weight's loader cut to experts ``ids``: ``sub()`` -> ``[n, ...]`` f32, ``sub(e)`` -> global
    expert ``ids[e]`` alone, ``sub.qtensor()`` -> the stored QTensor's rows ``ids`` (None when the file stores it
    otherwise), ``sub.experts`` = ``(ids, E)`` for a transform that needs the global ids (a plan's per-expert formats,
    a bundle's per-expert keys). A loader that reads only the whole stack (a GGUF's) is read once and cut."""
    ids = np.asarray(ids, np.int64)
    whole = {}

    def full():
        if "a" not in whole:
            whole["a"] = np.ascontiguousarray(load()[ids])
        return whole["a"]

    if _per_expert(load):
        def sub(e=None):
            if e is None:
                return np.stack([load(int(g)) for g in ids])
            return load(int(ids[e]))
    else:
        def sub(e=None):
            return full() if e is None else full()[e]

    if hasattr(load, "qtensor"):
        def qtensor():
            qt = load.qtensor()
            return None if qt is None else take_experts(qt, ids)
        sub.qtensor = qtensor
    sub.experts = (ids, E)
    return sub
