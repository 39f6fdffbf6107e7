"""``moqe info --ep N``: what each process of an expert-parallel run holds, and what a hop moves, from the config
alone (nothing loaded).

Bytes per rank: its routed experts in the Numba kernels' layout of the format (``packed_bytes``, as ``moqe info``
sizes a whole model); the driver: everything else (``resident_estimate``'s "rest"). Hop bytes per decode token: a
rank receives a token's row when one of its experts is among the token's ``A`` (``x`` f32 ``[D]``, ids int32 and
weights f32 ``[A]``) and sends back its share ``[D]`` f32; under uniform routing a rank holding ``k`` of ``E``
experts sees a token with probability ``1 - C(E-k, A) / C(E, A)`` in each MoE layer.
"""
from __future__ import annotations

from math import comb

ROW_OUT = lambda D, A: 4 * D + 8 * A  # noqa: E731  one token's message to a rank: x, ids, weights
ROW_BACK = lambda D: 4 * D  # noqa: E731  one token's answer


def _experts_label(split, r: int, layers) -> str:
    """'0-3' when rank ``r`` holds the same contiguous run in every MoE layer, else its count per layer."""
    first = split.experts(r, layers[0])
    same = all(list(split.experts(r, i)) == list(first) for i in layers)
    if same and len(first) and first[-1] - first[0] == len(first) - 1:
        return f"{first[0]}-{first[-1]}" if len(first) > 1 else str(first[0])
    counts = sorted({len(split.experts(r, i)) for i in layers})
    return f"{'/'.join(map(str, counts))} per layer (by trace)"


def rank_rows(cfg, split, fmt: str | None = None, activations: str | None = None) -> list[dict]:
    """One row per rank and one for the driver: experts held, their bytes, and hop bytes per decode token."""
    from ..formats import get_format
    from ..model.inspect import packed_bytes, resident_estimate

    f = get_format(fmt or "f32")
    D, I, E, A = cfg.hidden_size, cfg.expert_intermediate, cfg.num_experts, cfg.top_k
    one = packed_bytes(f, 2 * I, D, activations=activations) + packed_bytes(f, D, I, activations=activations)
    layers = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    total = one * E * len(layers)
    rows = []
    for r in range(split.ranks):
        held = sum(len(split.experts(r, i)) for i in layers)
        seen = sum(1 - comb(E - len(split.experts(r, i)), A) / comb(E, A) for i in layers)  # expected MoE layers
        rows.append({"process": f"rank {r}", "experts per MoE layer": _experts_label(split, r, layers),
                     "expert bytes": held * one, "share of experts": held * one / total, "other weight bytes": 0,
                     "hop bytes per token (uniform routing)": int(round(seen * (ROW_OUT(D, A) + ROW_BACK(D))))})
    rest = resident_estimate(cfg, (f.spec,), activations)[0]["rest GB"]
    rows.append({"process": "driver", "experts per MoE layer": "none", "expert bytes": 0, "share of experts": 0.0,
                 "other weight bytes": int(round(rest * 1e9)) if rest is not None else None,
                 "hop bytes per token (uniform routing)": sum(r["hop bytes per token (uniform routing)"] for r in rows)})
    return rows
