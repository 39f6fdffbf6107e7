"""The FFN parts of a decoder layer: the routed MoE block (router -> routed experts -> combine, plus a
shared expert) and the dense MLP of the layers that have no experts.

Shape legend: ``T`` tokens, ``D`` hidden, ``E`` experts, ``A`` active experts per token.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import ModelError
from ..formats import QTensor, get_format
from ..formats.mixed import MixedExperts, pair_groups
from .config import ModelConfig
from .linear import Linear
from .runtime import Runtime


class MoEBlock:
    """Router -> routed experts (SwiGLU) -> combine, plus the shared expert: with a sigmoid gate (Qwen2-MoE)
    or added as it is (DeepSeek)."""

    def __init__(self, cfg: ModelConfig, w: dict, rt: Runtime, experts=None, layer: int | None = None):
        self.rt = rt
        self.router = Linear(w["router"], w.get("router_bias"), rt=rt)  # [E, D] (+ a logit bias [E], gpt-oss)
        self.route = cfg.family.router.route(cfg, w, rt)  # logits [T, E] -> (weights, ids) [T, A]
        self.select_bias = w.get("select_bias")
        self.silu_and_mul = rt.op("silu_and_mul")
        host = rt.host_experts(layer) if experts is None else None  # [E] True: on the host (a placement), or None
        # the expert part: SwiGLU, or gpt-oss's clamped SwiGLU with a bias on each projection
        bias = (rt.weight(w["gate_up_bias"]), rt.weight(w["down_bias"])) if (
            w.get("gate_up_bias") is not None and host is None and experts is None) else None
        act, extra = cfg.expert_act, {}
        if bias is not None or act is not None:
            extra = {"bias": bias, "act": act}
        bias_bytes = sum(b.nbytes for b in bias) if bias is not None else 0
        self.expert_weights = None  # (gate_up, down) as placed, for the compiled decode step: plain SwiGLU only
        if host is not None:  # routed experts on both sides of the bus (or all on the host): see hybrid_experts
            experts = hybrid_experts(rt, w, host, act)
        if experts is None and isinstance(w["gate_up"], QTensor | MixedExperts) != isinstance(w["down"], QTensor | MixedExperts):
            # one stored quantized, the other not (a GGUF with k-quant ffn_down only): the plain one as an f32 QTensor
            w = {**w, **{k: get_format("f32").quantize(rt.host(w[k])) for k in ("gate_up", "down")
                         if not isinstance(w[k], QTensor | MixedExperts)}}
        if experts is None and (isinstance(w["gate_up"], MixedExperts) or isinstance(w["down"], MixedExperts)):
            if extra:
                raise ModelError("experts stored at mixed widths run plain SwiGLU experts only; this layer's experts "
                                 "have biases or another activation (quantize them with one format)")
            experts = mixed_experts(rt, w["gate_up"], w["down"])
        if experts is None and isinstance(w["gate_up"], QTensor):  # quantized experts: the grouped pipeline
            fused_moe = rt.op("fused_moe")
            gate_up, down = rt.qweight(w["gate_up"], "moe.gate_up"), rt.qweight(w["down"], "moe.down")
            experts = lambda x, ids, wts: fused_moe(x, wts, ids, gate_up, down, **extra)  # noqa: E731
            experts.nbytes = gate_up.nbytes + down.nbytes + bias_bytes
            self.expert_weights = None if extra else (gate_up, down)
        if experts is None:
            moe_experts = rt.op("moe_experts")
            gate_up, down = rt.weight(w["gate_up"]), rt.weight(w["down"])
            experts = lambda x, ids, wts: moe_experts(x, ids, wts, gate_up, down, **extra)  # noqa: E731
            experts.nbytes = gate_up.nbytes + down.nbytes + bias_bytes
            self.expert_weights = None if extra else (gate_up, down)
        self.experts = experts
        self.shared = None
        if "shared_gate_up" in w:
            gate = Linear(w["shared_gate"], rt=rt) if "shared_gate" in w else None
            self.shared = (Linear(w["shared_gate_up"], rt=rt), Linear(w["shared_down"], rt=rt), gate)

    def __call__(self, x):  # [T, D] -> [T, D]
        logits = self.router(x)  # [T, E]
        weights, ids = self.route(logits)  # [T, A], [T, A]
        y = self.experts(x, ids, weights)  # [T, D]
        if self.shared is not None:
            gate_up, down, gate = self.shared
            s = down(self.silu_and_mul(gate_up(x)))  # [T, D]
            y = self.rt.add(y, s) if gate is None else self.rt.gated_add(y, s, gate(x))  # y += s (* sigmoid(gate(x)))
        return y

    @property
    def other_bytes(self) -> int:
        """Router and shared expert bytes (everything of the block but the routed experts)."""
        bias = self.select_bias.nbytes if self.select_bias is not None else 0
        return self.router.nbytes + bias + (sum(l.nbytes for l in self.shared if l is not None) if self.shared else 0)


def mixed_experts(rt: Runtime, gate_up, down):
    """Experts at mixed widths: one ``fused_moe`` per (gate_up format, down format) group of experts, each with
    its ``expert_map`` (global id -> index in the group, -1 elsewhere), the groups' ``[T, D]`` outputs summed."""
    return mapped_experts(rt, gate_up, down, np.arange(gate_up.shape[0]), gate_up.shape[0])


def mapped_experts(rt: Runtime, gate_up, down, ids, E: int, bias=None, act=None):
    """Routed experts ``ids`` (global, ``[n]``) of a layer of ``E``, held stacked ``gate_up [n, 2I, D]``,
    ``down [n, D, I]`` (each a QTensor, MixedExperts or f32 array; ``bias``: their ``([n, 2I], [n, D])`` or None) ->
    ``experts(x [T, D], ids [T, A] global, wts [T, A]) -> [T, D]``: one ``fused_moe`` per (gate_up format, down
    format) group, its ``expert_map`` sending each global id to its index in the group (-1 elsewhere, a slot that
    adds nothing), the groups' outputs summed. An expert rank's share of a layer (``toolkit/dist``), or a layer's
    experts at mixed widths."""
    fused_moe = rt.op("fused_moe")
    ids = np.asarray(ids, np.int64)
    as_q = lambda a: a if isinstance(a, QTensor | MixedExperts) else get_format("f32").quantize(np.asarray(rt.host(a), np.float32))  # noqa: E731
    host = lambda w: w if isinstance(w, MixedExperts) else QTensor(w.fmt, w.shape, {k: rt.host(a) for k, a in w.arrays.items()})  # noqa: E731
    gu, dn = as_q(gate_up), as_q(down)
    if isinstance(gu, MixedExperts) or isinstance(dn, MixedExperts):
        groups = pair_groups(host(gu), host(dn))
    else:  # one format each side: one call over the stack as it is
        groups = [(tuple(range(len(ids))), gu, dn)]
    bias = None if bias is None else tuple(rt.host(b) for b in bias)
    parts = []
    for idx, g, d in groups:
        m = np.full(E, -1, np.int32)  # [E] global expert -> index in the group
        m[ids[list(idx)]] = np.arange(len(idx), dtype=np.int32)
        extra = {} if bias is None and act is None else {
            "bias": None if bias is None else (rt.weight(bias[0][list(idx)]), rt.weight(bias[1][list(idx)])), "act": act}
        parts.append((rt.qweight(g, "moe.gate_up"), rt.qweight(d, "moe.down"), rt.weight(m, np.int32), extra))

    def experts(x, tids, wts):  # [T, D], [T, A], [T, A] -> [T, D]
        y = None
        for g, d, m, extra in parts:
            yg = fused_moe(x, wts, tids, g, d, expert_map=m, **extra)
            y = yg if y is None else rt.add(y, yg)
        return y

    experts.nbytes = sum(g.nbytes + d.nbytes for g, d, _, _ in parts) + (sum(b.nbytes for b in bias) if bias else 0)
    experts.groups = len(parts)
    return experts


def hybrid_experts(rt: Runtime, w: dict, host: np.ndarray, act=None):
    """A layer's routed experts split by place (``host [E]``: True on the host), on a device runtime: the device
    groups run the CUDA ``fused_moe``, the host groups the Numba one (``rt.host_rt``, any format), each group one
    call with its ``expert_map``, grouped by (place, gate_up format, down format).

    A call copies out the routing (``ids``, ``weights`` ``[T, A]``) and the hidden rows of the tokens routed to a
    host expert, launches the device groups (on a GPU they run while the host computes: nothing the host does
    waits for them), runs the host groups on those rows, copies their ``[n, D]`` sum in and adds it to the device's
    rows (``add_rows``). Bytes per call: ``toolkit.model.placement.layer_bus_bytes``; no weight byte crosses."""
    from ..formats import get_format

    hrt = rt.host_rt
    E = w["gate_up"].shape[0]
    as_q = lambda a: a if isinstance(a, QTensor | MixedExperts) else get_format("f32").quantize(np.asarray(a, np.float32))  # noqa: E731
    bias = (np.asarray(w["gate_up_bias"], np.float32), np.asarray(w["down_bias"], np.float32)) if "gate_up_bias" in w else None
    dev_parts, host_parts = [], []
    for ids, gu, dn in pair_groups(as_q(w["gate_up"]), as_q(w["down"]), key=lambda e: bool(host[e])):
        m = np.full(E, -1, np.int32)  # [E] global expert -> index in the group
        m[list(ids)] = np.arange(len(ids), dtype=np.int32)
        b = None if bias is None else (bias[0][list(ids)], bias[1][list(ids)])  # the group's own biases
        extra = {} if b is None and act is None else {"bias": b, "act": act}
        if host[ids[0]]:
            host_parts.append((hrt.qweight(gu, "moe.gate_up"), hrt.qweight(dn, "moe.down"), m, extra))
        else:
            if b is not None:
                extra["bias"] = (rt.weight(b[0]), rt.weight(b[1]))
            dev_parts.append((rt.qweight(gu, "moe.gate_up"), rt.qweight(dn, "moe.down"), rt.weight(m, np.int32), extra))
    dev_moe, host_moe = rt.op("fused_moe"), hrt.op("fused_moe")
    gather, add_rows = rt.op("gather_rows"), rt.op("add_rows")

    def experts(x, ids, wts):  # [T, D], [T, A], [T, A] on the device -> [T, D] on the device
        T, D = x.shape
        ids_h, wts_h = rt.host(ids), rt.host(wts)  # [T, A]: the routing, to the host
        rows = np.flatnonzero(host[ids_h].any(1))  # [n] tokens routed to a host expert
        if rows.size:
            rows_d = rt.ids(rows)  # [n] int32 on the device
            xr = rt.host(gather(x, rows_d))  # [n, D]: only those tokens' hidden rows cross
        y = None
        for gu, dn, m, extra in dev_parts:  # launched before the host works: on a GPU they overlap it
            yg = dev_moe(x, wts, ids, gu, dn, expert_map=m, **extra)
            y = yg if y is None else rt.add(y, yg)
        if y is None:
            y = rt.zeros((T, D), np.float32)
        if rows.size:
            t0 = time.perf_counter()
            ih, wh, yh = ids_h[rows], wts_h[rows], None
            for gu, dn, m, extra in host_parts:
                yg = host_moe(xr, wh, ih, gu, dn, expert_map=m, **extra)  # [n, D]
                yh = yg if yh is None else yh + yg
            experts.host_s += time.perf_counter() - t0  # the host group's own time (bench placement)
            add_rows(y, rt.weight(yh), rows_d)  # y[rows] += the host's rows
        return y

    experts.nbytes = sum(gu.nbytes + dn.nbytes for gu, dn, _, _ in dev_parts + host_parts)
    experts.host_nbytes = sum(gu.nbytes + dn.nbytes for gu, dn, _, _ in host_parts)
    experts.groups = len(dev_parts) + len(host_parts)
    experts.host = host
    experts.host_s = 0.0
    return experts


class DenseMLP:
    def __init__(self, w: dict, rt: Runtime):
        self.gate_up, self.down = Linear(w["gate_up"], rt=rt), Linear(w["down"], rt=rt)
        self.silu_and_mul = rt.op("silu_and_mul")

    def __call__(self, x):
        return self.down(self.silu_and_mul(self.gate_up(x)))
