"""Routed experts stored at more than one width: a layer's ``[E, N, K]`` expert weight as groups of experts,
each group one stacked :class:`QTensor` in its own format (a planned mix, ``moqe plan``).

The grouped MoE pipeline runs one ``fused_moe`` per group, its ``expert_map`` sending each global expert id
to its index in the group (-1 for the others), and sums the groups' outputs (``toolkit/model/model.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from .base import Format, QTensor


@dataclass(frozen=True)
class ExpertGroup:
    experts: tuple[int, ...]  # global expert ids, ascending
    weight: QTensor  # [len(experts), N, K]

    @property
    def fmt(self) -> Format:
        return self.weight.fmt


@dataclass(frozen=True)
class MixedExperts:
    """``shape`` ``[E, N, K]``; ``groups``: one per format, disjoint, covering every expert (ordered by the
    first expert of each group)."""

    shape: tuple[int, int, int]
    groups: tuple[ExpertGroup, ...]

    def __post_init__(self):
        E = self.shape[0]
        seen = sorted(e for g in self.groups for e in g.experts)
        if seen != list(range(E)):
            raise FormatError(f"mixed experts: the groups hold experts {seen}, expected each of 0..{E - 1} once")
        for g in self.groups:
            if tuple(g.weight.shape) != (len(g.experts),) + tuple(self.shape[1:]):
                raise FormatError(f"mixed experts: the {g.fmt.spec} group of {len(g.experts)} experts has shape "
                                  f"{list(g.weight.shape)}, expected {[len(g.experts), *self.shape[1:]]}")

    @property
    def nbytes(self) -> int:
        return sum(g.weight.nbytes for g in self.groups)

    def format_of(self, e: int) -> Format:
        return next(g.fmt for g in self.groups if e in g.experts)

    @property
    def label(self) -> str:
        """``int4-g128x5+int8x3``: each group's format and expert count."""
        return "+".join(f"{g.fmt.spec}x{len(g.experts)}" for g in self.groups)

    def expert(self, e: int) -> QTensor:
        """Expert ``e`` alone, ``[N, K]`` in its group's format (views of the stored arrays)."""
        for g in self.groups:
            if e in g.experts:
                i = g.experts.index(e)
                return QTensor(g.fmt, tuple(self.shape[1:]), {k: a[i] for k, a in g.weight.arrays.items()})
        raise FormatError(f"mixed experts: no expert {e} (there are {self.shape[0]})")

    def dequantize(self, backend: str = "numpy") -> np.ndarray:
        out = np.empty(self.shape, np.float32)  # [E, N, K]
        for g in self.groups:
            out[list(g.experts)] = g.weight.dequantize(backend)
        return out

    def expert_map(self, g: ExpertGroup) -> np.ndarray:
        """int32 ``[E]``: global expert id -> its index in group ``g``, -1 for experts of other groups."""
        m = np.full(self.shape[0], -1, np.int32)
        m[list(g.experts)] = np.arange(len(g.experts), dtype=np.int32)
        return m

    def with_groups(self, place) -> MixedExperts:
        """The same layout with each group's QTensor passed through ``place`` (e.g. an upload to a device)."""
        return MixedExperts(self.shape, tuple(ExpertGroup(g.experts, place(g.weight)) for g in self.groups))


def stack_experts(parts: list[QTensor]) -> QTensor:
    """Per-expert QTensors ``[N, K]`` of one format -> ``[n, N, K]``."""
    fmt = parts[0].fmt
    arrays = {k: np.stack([p.arrays[k] for p in parts]) for k in parts[0].arrays}
    return QTensor(fmt, (len(parts),) + tuple(parts[0].shape), arrays)


def group_experts(parts: list[QTensor]) -> QTensor | MixedExperts:
    """Per-expert QTensors (expert order) -> one stacked QTensor when they share a format, else MixedExperts."""
    by: dict[str, list[int]] = {}
    for e, p in enumerate(parts):
        by.setdefault(p.fmt.spec, []).append(e)
    if len(by) == 1:
        return stack_experts(parts)
    shape = (len(parts),) + tuple(parts[0].shape)
    groups = [ExpertGroup(tuple(ids), stack_experts([parts[e] for e in ids])) for ids in by.values()]
    return MixedExperts(shape, tuple(sorted(groups, key=lambda g: g.experts[0])))


def pair_groups(gate_up, down, key=None) -> list[tuple[tuple[int, ...], QTensor, QTensor]]:
    """Experts grouped by their (gate_up format, down format) pair -> ``[(experts, gate_up [n, 2I, D],
    down [n, D, I])]``: the units one ``fused_moe`` call runs. Either side may be a plain QTensor. ``key(e)``,
    when given, splits the groups further (an expert's place: host or device)."""
    E = gate_up.shape[0]

    def fmt(w, e):
        return w.format_of(e) if isinstance(w, MixedExperts) else w.fmt

    def slab(w, e):
        if isinstance(w, MixedExperts):
            return w.expert(e)
        return QTensor(w.fmt, tuple(w.shape[1:]), {k: a[e] for k, a in w.arrays.items()})

    by: dict[tuple, list[int]] = {}
    for e in range(E):
        by.setdefault((key(e) if key else None, fmt(gate_up, e).spec, fmt(down, e).spec), []).append(e)
    return [(tuple(ids), stack_experts([slab(gate_up, e) for e in ids]), stack_experts([slab(down, e) for e in ids]))
            for ids in by.values()]
