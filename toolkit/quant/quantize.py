"""Quantize a checkpoint while it streams in: one tensor (one expert slab) at a time, from the
memory-mapped file, so peak memory stays near the quantized model's size plus one expert in f32."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..formats import QTensor, get_format
from ..formats.mixed import group_experts, stack_experts
from .imatrix import quantize_weighted
from .policy import Policy


def quantize_stacked(fmt, load, n: int, backend: str, name: str, importance=lambda e: None) -> QTensor:
    """Quantize ``n`` slabs ``load(e) -> [out, in]`` into one QTensor ``[n, out, in]`` (slab by slab);
    ``importance(e)``: expert e's calibrated importance [in] or None (``toolkit/quant/imatrix.py``)."""
    return stack_experts([quantize_weighted(fmt, load(e), importance(e), backend, name=name.replace("*", str(e)))
                          for e in range(n)])


def quantize_experts(fmts: list, load, backend: str, name: str, importance=lambda e: None):
    """Expert ``e`` of ``load(e) -> [out, in]`` in ``fmts[e]`` (None: f32) -> MixedExperts (one group per format)."""
    f32 = get_format("f32")
    parts = [quantize_weighted(f or f32, load(e), importance(e), backend, name=name.replace("*", str(e)))
             for e, f in enumerate(fmts)]
    return group_experts(parts)


def expert_name(name: str, experts) -> str:
    """``model.layers.3.moe.experts.*.w2`` of experts (1, 4) -> ``model.layers.3.moe.experts.{1,4}.w2``."""
    return name.replace("*", "{" + ",".join(map(str, experts)) + "}")


@dataclass
class QuantReport:
    """Which weight got which format, with bytes: the record a UQFF bundle and `moqe quantize` print."""

    policy: str
    rows: list[dict] = field(default_factory=list)

    def add(self, name: str, role: str, fmt: str, shape: tuple, nbytes: int) -> None:
        self.rows.append({"name": name, "role": role, "format": fmt, "shape": list(shape), "bytes": int(nbytes)})

    def summary(self) -> list[dict]:
        by: dict[str, list] = {}
        for r in self.rows:
            n = int(np.prod(r["shape"]))
            acc = by.setdefault(r["format"], [0, 0, 0])
            acc[0] += 1
            acc[1] += n
            acc[2] += r["bytes"]
        return [{"format": f, "tensors": v[0], "parameters": v[1], "bytes": v[2], "bits/weight": 8 * v[2] / max(1, v[1])}
                for f, v in sorted(by.items())]


def quantizing_transform(policy: Policy, backend: str, report: QuantReport | None = None, progress=None):
    """A ``transform(role, name, load, shape, layer)`` for ``load_weights`` that applies ``policy``."""
    codec_backend = "numpy" if backend == "numpy" else "numba"

    def transform(role, name, load, shape, layer=None):
        # a shard's experts (expert parallelism: ``load.experts`` = (global ids, E)): expert e of the stack is ids[e]
        ids, E = getattr(load, "experts", (None, shape[0] if len(shape) == 3 else 0))
        glob = (lambda e: e) if ids is None else (lambda e: int(ids[e]))
        fmts = None
        if len(shape) == 3:
            fmts = policy.expert_formats(role, name, layer, E)
            fmts = fmts if ids is None else [fmts[g] for g in ids]
        mixed = bool(fmts) and len({f.spec if f else None for f in fmts}) > 1  # a plan or an override tells this weight's experts apart
        fmt = fmts[0] if fmts else policy.format_for(role, name, layer)
        imp = lambda e: policy.importance(role, layer, glob(e))
        native = getattr(load, "qtensor", None)  # stored quantized: kept as stored unless the policy names another format
        stored = native() if native is not None and not mixed else None
        if stored is not None and (fmt is None or fmt == stored.fmt):
            out = stored
            f, nbytes = out.fmt.spec, out.nbytes
        elif mixed:
            out = quantize_experts(fmts, load, codec_backend, name, imp)  # MixedExperts: one group per format
            if report is not None:
                for g in out.groups:
                    report.add(expert_name(name, g.experts), role, g.fmt.spec, g.weight.shape, g.weight.nbytes)
            f = None
        elif fmt is None:
            out = load()
            f, nbytes = "f32", out.nbytes
        elif len(shape) == 3:
            out = quantize_stacked(fmt, load, shape[0], codec_backend, name, imp)
            f, nbytes = fmt.spec, out.nbytes
        else:
            out = fmt.quantize(load(), codec_backend, name=name)
            f, nbytes = fmt.spec, out.nbytes
        if f is not None and report is not None and role not in ("attn_norm", "ffn_norm") and not role.endswith("_bias"):
            report.add(name, role, f, shape, nbytes)
        if progress is not None:
            progress.update(1)
        return out

    return transform
