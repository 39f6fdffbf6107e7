"""Expert parts: the routed experts of a MoE block and its shared expert.

Roles: ``moe.gate_up [E, 2I, D]`` (gate rows, then up rows), ``moe.down [E, D, I]``, gpt-oss's biases
``moe.gate_up_bias [E, 2I]`` / ``moe.down_bias [E, D]``; the shared expert ``moe.shared_gate_up [2Is, D]``,
``moe.shared_down [D, Is]`` and its sigmoid gate ``moe.shared_gate [1, D]``. GGUF holds the experts merged per
projection ``[E, out, in]`` in every family.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ModelError
from . import Part, limit
from .loading import cat, shape_at, split_halves, stacked, where

OAI_SWIGLU = (1.702, 7.0)  # llama.cpp's fixed alpha and limit of gpt-oss's clamped SwiGLU (ggml_swiglu_oai)
EXPERT_NAMES = {"moe.gate": "blk.{i}.ffn_gate_exps.weight", "moe.up": "blk.{i}.ffn_up_exps.weight",
                "moe.down": "blk.{i}.ffn_down_exps.weight", "moe.gate_bias": "blk.{i}.ffn_gate_exps.bias",
                "moe.up_bias": "blk.{i}.ffn_up_exps.bias", "moe.down_bias": "blk.{i}.ffn_down_exps.bias"}
SHARED_NAMES = {"moe.shared_gate_proj": "blk.{i}.ffn_gate_shexp.weight", "moe.shared_up": "blk.{i}.ffn_up_shexp.weight",
                "moe.shared_down": "blk.{i}.ffn_down_shexp.weight", "moe.shared_gate": "blk.{i}.ffn_gate_inp_shexp.weight"}


@dataclass(frozen=True)
class Shared(Part):
    """One shared expert of ``size_key`` intermediate size (0: none), run on every token beside the routed ones;
    with a sigmoid gate on its output when ``gate`` names the gate's module (Qwen2-MoE)."""

    size_key: str = "shared_expert_intermediate_size"
    module: str = "shared_expert"
    gate: str | None = "shared_expert_gate"
    gguf_names = SHARED_NAMES

    def size(self, k) -> int:
        return k.int(self.size_key, 0, limit="intermediate_size")

    def hf_tensors(self, t, prefix: str):
        get, D, Is = t.get, t.cfg.hidden_size, t.cfg.shared_intermediate
        s = f"{prefix}.{self.module}"
        yield "moe.shared_gate_up", f"{s}.gate_proj+up_proj", (lambda: cat(get, [f"{s}.gate_proj.weight", f"{s}.up_proj.weight"], (Is, D))), (2 * Is, D)
        yield "moe.shared_down", f"{s}.down_proj.weight", lambda: get(f"{s}.down_proj.weight"), (D, Is)
        if self.gate:  # a sigmoid gate on the shared expert's output
            yield "moe.shared_gate", f"{prefix}.{self.gate}.weight", lambda: get(f"{prefix}.{self.gate}.weight"), (1, D)

    def describe(self, cfg) -> str:
        return f", plus a shared expert ({cfg.shared_intermediate})" + (" with a sigmoid gate" if self.gate else "")

    def parameters(self, cfg) -> int:
        return 3 * cfg.shared_intermediate * cfg.hidden_size + (cfg.hidden_size if self.gate else 0)

    def gguf_config(self, m, raw: dict) -> None:
        raw[self.size_key] = m.n("expert_shared_feed_forward_length", *limit("intermediate_size"), 0)

    def gguf_metadata(self, w, cfg) -> None:
        if cfg.shared_intermediate:
            w.add_expert_shared_feed_forward_length(cfg.shared_intermediate)

    def gguf_tensors(self, g) -> dict:
        cfg, n, ts = g.cfg, g.n, g.ts
        D, Is = cfg.hidden_size, cfg.shared_intermediate
        out = {"shared_gate_up": g.keep("moe.shared_gate_up", f"{n['moe.shared_gate_proj']}+{n['moe.shared_up']}",
                                        (2 * Is, D), g.i, load=g.join(n["moe.shared_gate_proj"], n["moe.shared_up"], (Is, D))),
               "shared_down": g.keep("moe.shared_down", n["moe.shared_down"], (D, Is), g.i)}
        if n["moe.shared_gate"] in ts.t:
            out["shared_gate"] = ts.f32_any(n["moe.shared_gate"], (1, D))
        return out

    def gguf_weights(self, cfg, n: dict, m: dict):
        from ...uqff.keys import split_rows

        sg, su = split_rows(m["shared_gate_up"], 2)
        yield n["moe.shared_gate_proj"], sg
        yield n["moe.shared_up"], su
        yield n["moe.shared_down"], m["shared_down"]
        if "shared_gate" in m:
            yield n["moe.shared_gate"], m["shared_gate"]


@dataclass(frozen=True)
class SharedCount(Shared):
    """``count_key`` shared experts of ``size_key`` each, run as one MLP and added ungated (DeepSeek:
    ``moe_intermediate_size * n_shared_experts``). ``gguf_length``: the GGUF also carries its size (GLM-4.5)."""

    size_key: str = "moe_intermediate_size"
    count_key: str = "n_shared_experts"
    module: str = "shared_experts"
    gate: str | None = None
    gguf_length: bool = False

    def size(self, k) -> int:
        return k.int(self.size_key, 0, limit="intermediate_size") * k.int(self.count_key, 0, lo=0, hi=1024)

    def gguf_config(self, m, raw: dict) -> None:
        raw[self.count_key] = m.n("expert_shared_count", 0, 1024, 0)

    def gguf_metadata(self, w, cfg) -> None:
        if self.gguf_length:
            super().gguf_metadata(w, cfg)
        w.add_expert_shared_count(cfg.shared_intermediate // cfg.expert_intermediate)


@dataclass(frozen=True)
class SwiGLU(Part):
    """Routed SwiGLU experts, ``silu(gate) * up -> down``, no biases. ``count_key`` (or one of ``count_aliases``)
    holds the expert count, ``size_key`` their intermediate size. Checkpoint layouts: per expert
    (``{prefix}.experts.N.{gate,up,down}`` with the projection ``names``) or fused as transformers 5 keeps them in
    memory (``experts.gate_up_proj``, ``experts.down_proj``); ``prefixes``: the MoE block's module inside a layer,
    in order of preference. ``gguf_ff``: GGUF's ``expert_feed_forward_length`` holds their size (else
    ``feed_forward_length``)."""

    count_key: str = "num_experts"
    size_key: str = "moe_intermediate_size"
    count_aliases: tuple = ()
    names: tuple = ("gate_proj", "up_proj", "down_proj")
    prefixes: tuple = ("mlp",)
    shared: Shared | None = None
    gguf_ff: bool = True
    gguf_names = EXPERT_NAMES

    @property
    def subparts(self) -> tuple:
        """The shared expert, a part of its own (the family reads its keys and writes its metadata)."""
        return (self.shared,) if self.shared else ()

    def config(self, k, c: dict) -> None:
        from ...model.schema import relation

        key = next((x for x in (self.count_key, *self.count_aliases) if k.raw.get(x) is not None), self.count_key)
        n_exp = k.int(key, limit="num_experts")
        top_k = k.int("num_experts_per_tok")
        relation(top_k <= n_exp, k.source, f"num_experts_per_tok ({top_k}) must be at most {key} ({n_exp})")
        c.update(experts_key=key, num_experts=n_exp, top_k=top_k,
                 expert_intermediate=k.int(self.size_key, lo=1, hi=1 << 20),
                 shared_intermediate=self.shared.size(k) if self.shared else 0)

    def hf_tensors(self, t, prefix: str):
        ck, get, cfg = t.ck, t.get, t.cfg
        E, I, D = cfg.num_experts, cfg.expert_intermediate, cfg.hidden_size
        g, u, d = self.names
        if f"{prefix}.experts.gate_up_proj" in ck:  # fused layout (transformers 5 in memory)
            gu, dn = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
            yield "moe.gate_up", gu, stacked(lambda e: ck.get(gu)[e], get, gu, E, (2 * I, D)), (E, 2 * I, D)
            yield "moe.down", dn, stacked(lambda e: ck.get(dn)[e], get, dn, E, (D, I)), (E, D, I)
        else:
            ex = f"{prefix}.experts"
            gate_up = lambda e: cat(get, [f"{ex}.{e}.{g}.weight", f"{ex}.{e}.{u}.weight"], (I, D))  # noqa: E731
            yield "moe.gate_up", f"{ex}.*.{g}+{u}", stacked(gate_up, None, f"{ex}.*.{g}+{u}", E, (2 * I, D)), (E, 2 * I, D)
            yield "moe.down", f"{ex}.*.{d}", stacked(lambda e: get(f"{ex}.{e}.{d}.weight"), None, f"{ex}.*.{d}", E, (D, I)), (E, D, I)
        if cfg.shared_intermediate:
            yield from self.shared.hf_tensors(t, prefix)

    def _act(self, cfg) -> str:
        return "SwiGLU"

    def describe(self, cfg) -> str:
        return self._act(cfg) + (self.shared.describe(cfg) if cfg.shared_intermediate else "")

    def parameters(self, cfg) -> tuple[int, int]:
        """Per routed layer: (routed experts, the rest of the block: the shared expert)."""
        return (cfg.num_experts * 3 * cfg.expert_intermediate * cfg.hidden_size,
                self.shared.parameters(cfg) if cfg.shared_intermediate else 0)

    # ---- GGUF ----
    def gguf_config(self, m, raw: dict) -> None:
        raw[self.count_key] = m.n_exp
        raw[self.size_key] = m.n("expert_feed_forward_length" if self.gguf_ff else "feed_forward_length", 1,
                                 limit("intermediate_size")[1])
        if self.gguf_ff:
            raw["intermediate_size"] = m.n("feed_forward_length", *limit("intermediate_size"), 0)

    def gguf_metadata(self, w, cfg) -> None:
        w.add_feed_forward_length(cfg.dense_intermediate if self.gguf_ff and cfg.dense_intermediate
                                  else cfg.expert_intermediate)
        if self.gguf_ff:
            w.add_expert_feed_forward_length(cfg.expert_intermediate)

    def gguf_tensors(self, g) -> dict:
        cfg, n, ts, keep, i = g.cfg, g.n, g.ts, g.keep, g.i
        D, E, I = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate
        out = {"gate_up": keep("moe.gate_up", f"{n['moe.gate']}+{n['moe.up']}", (E, 2 * I, D), i,
                               load=g.join(n["moe.gate"], n["moe.up"], (E, I, D))),
               "down": keep("moe.down", n["moe.down"], (E, D, I), i)}
        if n["moe.gate_bias"] in ts.t:  # a bias on every expert projection (gpt-oss)
            out["gate_up_bias"] = np.concatenate([ts.f32(n["moe.gate_bias"], (E, I)), ts.f32(n["moe.up_bias"], (E, I))],
                                                 axis=-1)
            out["down_bias"] = ts.f32(n["moe.down_bias"], (E, D))
        if cfg.shared_intermediate:
            out.update(self.shared.gguf_tensors(g))
        return out

    def gguf_weights(self, cfg, n: dict, m: dict):
        from ...errors import FormatError
        from ...formats.mixed import MixedExperts
        from ...uqff.keys import split_rows

        if any(isinstance(m[k], MixedExperts) for k in ("gate_up", "down")):
            mixed = next(m[k] for k in ("gate_up", "down") if isinstance(m[k], MixedExperts))
            raise FormatError(f"layer {n['moe.gate'].split('.')[1]}: its experts are stored at mixed widths "
                              f"({mixed.label}); GGUF holds a layer's experts in one tensor of one type: save a UQFF "
                              f"bundle instead")
        gate, up = split_rows(m["gate_up"], 2)  # [E, 2I, D] -> [E, I, D] x 2
        yield n["moe.gate"], gate
        yield n["moe.up"], up
        yield n["moe.down"], m["down"]
        if "gate_up_bias" in m:  # [E, 2I] -> gate [E, I], up [E, I]
            gb, ub = split_halves(m["gate_up_bias"])
            yield n["moe.gate_bias"], gb
            yield n["moe.up_bias"], ub
            yield n["moe.down_bias"], m["down_bias"]
        if "shared_gate_up" in m:
            yield from self.shared.gguf_weights(cfg, n, m)


@dataclass(frozen=True)
class ClampedSwiGLU(SwiGLU):
    """gpt-oss's experts: biases on both projections, gate/up clamped to ``swiglu_limit``,
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``. Checkpoint layout ``[E, D, 2I]`` with gate/up interleaved on
    the last axis and ``[E, I, D]`` down (in x out, as transformers 5 saves them), or the released MXFP4
    ``*_blocks [E, out, in/32, 16]`` / ``*_scales [E, out, in/32]``, read natively. GGUF: llama.cpp fixes alpha
    1.702 and limit 7."""

    count_key: str = "num_local_experts"
    size_key: str = "intermediate_size"
    compiled = False  # the compiled decode step runs SwiGLU without expert biases

    def config(self, k, c: dict) -> None:
        super().config(k, c)
        c["expert_act"] = ("clamped_swiglu", k.float("swiglu_alpha", 1.702, lo=0, hi=1e3),
                           k.float("swiglu_limit", 7.0, lo=0, hi=1e6, lo_open=True))

    def hf_tensors(self, t, prefix: str):
        cfg = t.cfg
        yield from _gpt_oss_experts(t.ck, t.get, f"{prefix}.experts", cfg.num_experts, cfg.expert_intermediate,
                                    cfg.hidden_size)
        if cfg.shared_intermediate:
            yield from self.shared.hf_tensors(t, prefix)

    def _act(self, cfg) -> str:
        _, alpha, limit = cfg.expert_act
        return f"clamped SwiGLU (alpha {alpha:g}, limit {limit:g}), biases on both projections"

    def parameters(self, cfg) -> tuple[int, int]:
        experts, rest = super().parameters(cfg)
        return experts + cfg.num_experts * (2 * cfg.expert_intermediate + cfg.hidden_size), rest

    def gguf_config(self, m, raw: dict) -> None:
        super().gguf_config(m, raw)
        raw["swiglu_alpha"], raw["swiglu_limit"] = OAI_SWIGLU

    def gguf_problems(self, cfg) -> list:
        return (["a clamped SwiGLU other than alpha 1.702, limit 7"]
                if tuple(float(v) for v in cfg.expert_act[1:]) != OAI_SWIGLU else [])


def _gpt_oss_experts(ck, get, ex: str, E: int, I: int, D: int):
    """gpt-oss's experts -> our ``gate_up [E, 2I, D]`` (gate rows, then up rows) and ``down [E, D, I]``, plus their
    biases ``[E, 2I]`` / ``[E, D]``. The checkpoint interleaves gate and up (gate = even columns) and stores either
    f32/bf16 ``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]`` or the MXFP4 ``*_blocks`` / ``*_scales``, which
    stay MXFP4: the loader's ``qtensor()`` repacks the blocks (a byte permutation, nothing dequantized); ``load()``
    decodes for a policy that requantizes them."""
    perm = np.concatenate([np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)])  # gate columns, then up columns
    for role, base, rows, shape in (("moe.gate_up", f"{ex}.gate_up_proj", perm, (E, 2 * I, D)),
                                    ("moe.down", f"{ex}.down_proj", None, (E, D, I))):
        if f"{base}_blocks" in ck:
            yield role, base, _mxfp4_experts(ck, base, rows, shape), shape
        else:
            yield role, base, _transposed_experts(ck, base, rows, shape), shape
    yield "moe.gate_up_bias", f"{ex}.gate_up_proj_bias", lambda: get(f"{ex}.gate_up_proj_bias")[:, perm], (E, 2 * I)
    yield "moe.down_bias", f"{ex}.down_proj_bias", lambda: get(f"{ex}.down_proj_bias"), (E, D)


def _transposed_experts(ck, base: str, rows, shape):
    """``[E, in, out]`` stored -> loader of ``[E, out, in]`` f32 (rows reordered by ``rows``), expert by expert."""
    E, N, K = shape

    def one(e):
        a = ck.get(base)
        shape_at(ck, base, a, (E, K, N))
        w = np.asarray(a[e], np.float32).T  # [out, in]
        return np.ascontiguousarray(w[rows] if rows is not None else w)

    return stacked(one, None, base, E, (N, K))


def _mxfp4_experts(ck, base: str, rows, shape):
    from ...formats import QTensor, get_format
    from ...formats.ggml import mxfp4_blocks_from_ocp

    E, N, K = shape
    fmt = get_format("mxfp4")

    def qtensor(e=None):
        blocks, scales = ck.get(f"{base}_blocks"), ck.get(f"{base}_scales")
        shape_at(ck, f"{base}_blocks", blocks, (E, N, K // 32, 16))
        shape_at(ck, f"{base}_scales", scales, (E, N, K // 32))
        if K % 32:
            raise ModelError(f"{where(ck, base + '_blocks')}: MXFP4 needs an input width divisible by 32, got {K}")
        sel = slice(None) if e is None else slice(e, e + 1)
        b, sc = np.asarray(blocks[sel]), np.asarray(scales[sel])
        if (sc == 255).any():
            raise ModelError(f"{where(ck, base + '_scales')}: tensor {base + '_scales'!r} holds the e8m0 NaN code 255")
        packed = mxfp4_blocks_from_ocp(b, sc)  # [E or 1, N, K/32 * 17]
        packed = np.ascontiguousarray(packed[:, rows] if rows is not None else packed)
        return QTensor(fmt, ((E,) if e is None else (1,)) + (N, K), {"blocks": packed})

    def load(e=None):  # f32, for a policy that requantizes (decoded expert by expert when e is given)
        if e is not None:
            return qtensor(e).dequantize("numpy")[0]
        return np.stack([qtensor(i).dequantize("numpy")[0] for i in range(E)])

    load.qtensor = qtensor
    return load
