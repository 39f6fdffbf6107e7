"""Parameter counts and bytes of a checkpoint, split into experts / attention / other (no weights loaded)."""
from __future__ import annotations

import numpy as np

from .checkpoint import Checkpoint
from .config import ModelConfig


def classify(name: str, cfg: ModelConfig) -> str:
    """'experts' for routed expert weights, 'attention' for attention projections, else 'other'."""
    if ".experts." in name and ".shared_expert" not in name:
        return "experts"
    if ".self_attn." in name:
        return "attention"
    return "other"


def parameter_summary(ck: Checkpoint, cfg: ModelConfig) -> list[dict]:
    totals: dict[str, list[int]] = {"experts": [0, 0], "attention": [0, 0], "other": [0, 0]}
    for name in ck.keys():
        a = ck.get(name)
        part = classify(name, cfg)
        totals[part][0] += int(np.prod(a.shape))
        totals[part][1] += int(a.nbytes)
    n_all = sum(v[0] for v in totals.values())
    rows = [{"part": k, "parameters": v[0], "share": f"{100 * v[0] / max(1, n_all):.1f} %", "bytes stored": v[1]}
            for k, v in totals.items()]
    rows.append({"part": "total", "parameters": n_all, "share": "100 %", "bytes stored": sum(v[1] for v in totals.values())})
    return rows
