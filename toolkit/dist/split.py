"""Which expert rank holds which routed expert of each MoE layer.

Contiguous by default (rank ``r`` holds experts ``[r*E/N, (r+1)*E/N)`` of every layer, vLLM's default), or balanced
from a routing trace (``moqe trace``): EPLB's idea without replicas. Each rank gets the same number of experts of a
layer (``E/N``, one more for the first ``E % N`` ranks), and the experts are dealt busiest first to the rank with the
fewest expected tokens that still has room, so every rank's expected share of the layer's routed slots is as even as
the counts allow.

Shape legend: ``L`` layers, ``E`` routed experts per layer, ``N`` ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelError


@dataclass(frozen=True)
class ExpertSplit:
    """``owner [L, E]`` int: the rank holding each routed expert (-1 on a dense layer's row); ``ranks`` N."""

    owner: np.ndarray
    ranks: int
    label: str

    def experts(self, rank: int, layer: int) -> np.ndarray:
        """The global ids, ascending, of the experts ``rank`` holds in ``layer``."""
        return np.flatnonzero(self.owner[layer] == rank)

    def rank_ids(self, rank: int) -> dict:
        """``{layer: global ids}`` of every MoE layer: what ``rank`` loads."""
        return {i: self.experts(rank, i) for i in range(len(self.owner)) if (self.owner[i] >= 0).all()}

    def loads(self, shares: np.ndarray, layers) -> np.ndarray:
        """``[len(layers), N]``: each rank's share of each MoE layer's routed slots, given ``shares [len(layers), E]``."""
        out = np.zeros((len(layers), self.ranks))
        for j, i in enumerate(layers):
            np.add.at(out[j], self.owner[i], shares[j])
        return out


def _sizes(E: int, N: int) -> list[int]:
    return [E // N + (r < E % N) for r in range(N)]


def _check(cfg, N: int) -> list[int]:
    E = cfg.num_experts
    if N < 1:
        raise ModelError(f"--ep must be at least 1, got {N}")
    if N > E:
        raise ModelError(f"--ep {N}: the model has {E} routed experts per layer; a rank needs at least one")
    return [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]


def contiguous(cfg, N: int) -> ExpertSplit:
    layers = _check(cfg, N)
    owner = np.full((cfg.num_layers, cfg.num_experts), -1, np.int64)
    row = np.repeat(np.arange(N), _sizes(cfg.num_experts, N))  # [E]
    owner[layers] = row
    return ExpertSplit(owner, N, f"contiguous, {N} rank{'s' if N > 1 else ''}")


def balanced(cfg, N: int, trace, where: str = "trace") -> ExpertSplit:
    """A split that evens each layer's expected tokens per rank, from ``trace`` (``toolkit.quant.trace.Trace``)."""
    from ..quant.joint_cli import check_trace

    layers = _check(cfg, N)
    check_trace(trace, cfg, where)
    owner = np.full((cfg.num_layers, cfg.num_experts), -1, np.int64)
    sizes = _sizes(cfg.num_experts, N)
    for j, i in enumerate(layers):
        counts = trace.counts[j]
        load, room = np.zeros(N), list(sizes)
        for e in sorted(range(cfg.num_experts), key=lambda e: (-counts[e], e)):  # busiest first
            r = min((r for r in range(N) if room[r]), key=lambda r: (load[r], r))
            owner[i, e] = r
            load[r] += counts[e]
            room[r] -= 1
    return ExpertSplit(owner, N, f"balanced from {where}, {N} rank{'s' if N > 1 else ''}")


def split_for(cfg, N: int, trace_path=None) -> ExpertSplit:
    """Contiguous, or balanced from the routing trace at ``trace_path``."""
    if trace_path is None:
        return contiguous(cfg, N)
    from ..quant.trace import load

    return balanced(cfg, N, load(trace_path), str(trace_path))
