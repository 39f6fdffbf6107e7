"""Router parts: ``logits [T, E] -> (weights, ids) [T, A]``, each one op of ``toolkit.ops``.

Roles: ``moe.router [E, D]``, ``moe.router_bias [E]`` (a logit bias), ``moe.select_bias [E]`` (a selection bias).
Routing variants are parameters of these parts, never branches on a family.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import Part

GATING = {"softmax": 1, "sigmoid": 2}  # llama.cpp's expert_gating_func


@dataclass(frozen=True)
class Softmax(Part):
    """Softmax over the experts, top-k, optionally renormalised (``norm_topk_prob``: ``norm_fixed`` when the family
    always does it, else the config's, ``norm_default`` when it is silent). gpt-oss's top-k of the logits then softmax
    over the chosen is this one renormalised. ``module``: the router's module inside the MoE block; ``logit_bias``:
    its linear has a bias. ``gguf_norm``: whether llama.cpp renormalises for the family (a fixed rule there)."""

    norm_default: bool = False
    norm_fixed: bool | None = None
    module: str = "gate"
    logit_bias: bool = False
    gguf_norm: bool = False
    select_bias = None

    @property
    def compiled(self) -> bool:  # the compiled decode step covers a softmax top-k without a logit bias
        return not self.logit_bias
    gguf_names = {"moe.router": "blk.{i}.ffn_gate_inp.weight", "moe.router_bias": "blk.{i}.ffn_gate_inp.bias"}

    def config(self, k, c: dict) -> None:
        c["norm_topk_prob"] = self.norm_fixed if self.norm_fixed is not None else k.bool("norm_topk_prob", self.norm_default)

    def route(self, cfg, w: dict, rt):
        op, k = rt.op("topk_softmax"), cfg.top_k
        return lambda logits: op(logits, k, cfg.norm_topk_prob)

    def hf_tensors(self, t, prefix: str):
        E, D, r, get = t.cfg.num_experts, t.cfg.hidden_size, f"{prefix}.{self.module}", t.get
        yield "moe.router", f"{r}.weight", lambda: get(f"{r}.weight"), (E, D)
        if self.logit_bias:  # added to the router's logits (gpt-oss)
            yield "moe.router_bias", f"{r}.bias", lambda: get(f"{r}.bias"), (E,)
        if self.select_bias:  # a selection bias (DeepSeek-V3's e_score_correction_bias)
            yield "moe.select_bias", f"{r}.{self.select_bias}", lambda: get(f"{r}.{self.select_bias}"), (E,)

    def describe(self, cfg) -> str:
        renorm = ", renormalised" if cfg.norm_topk_prob else " (not renormalised)"
        return f"softmax, top-{cfg.top_k}{renorm}" + (", with a logit bias" if self.logit_bias else "")

    def parameters(self, cfg) -> int:
        """Per routed layer: the router, and its bias."""
        return cfg.num_experts * cfg.hidden_size + (cfg.num_experts if self.logit_bias or self.select_bias else 0)

    # ---- GGUF ----
    def gguf_config(self, m, raw: dict) -> None:
        raw["norm_topk_prob"] = self.gguf_norm

    def gguf_problems(self, cfg) -> list:
        return (["top-k renormalisation other than llama.cpp's for this architecture"]
                if cfg.norm_topk_prob != self.gguf_norm else [])

    def gguf_tensors(self, g) -> dict:
        cfg, n, ts = g.cfg, g.n, g.ts
        E, D = cfg.num_experts, cfg.hidden_size
        out = {"router": g.keep("moe.router", n["moe.router"], (E, D), g.i, stored=False)}
        if self.logit_bias:
            out["router_bias"] = ts.f32(n["moe.router_bias"], (E,))
        return out

    def gguf_weights(self, cfg, n: dict, m: dict):
        yield n["moe.router"], m["router"]
        for role in ("router_bias", "select_bias"):  # gpt-oss's logit bias; DeepSeek-V3's selection bias
            if role in m:
                yield n[f"moe.{role}"], m[role]


@dataclass(frozen=True)
class _Grouped(Softmax):
    """DeepSeek's routers: experts in ``n_group`` groups, the best ``topk_group`` groups eligible, weights scaled by
    ``routed_scaling_factor``. GGUF: llama.cpp's expert_gating_func, groups, scale and renormalisation keys."""

    gating = "softmax"
    compiled = False

    def config(self, k, c: dict) -> None:
        from ...model.schema import relation

        super().config(k, c)
        n_exp, top_k, src, key = c["num_experts"], c["top_k"], k.source, c["experts_key"]
        n_group = k.int("n_group", None, lo=1, hi=n_exp) or 1
        topk_group = k.int("topk_group", None, lo=1, hi=n_group) or n_group
        relation(n_exp % n_group == 0, src, f"{key} ({n_exp}) must be a multiple of n_group ({n_group})")
        relation(top_k <= topk_group * (n_exp // n_group), src, f"num_experts_per_tok ({top_k}) exceeds the "
                 f"{topk_group * (n_exp // n_group)} experts of the topk_group ({topk_group}) best groups")
        c["n_group"], c["topk_group"] = n_group, topk_group
        c["routed_scale"] = k.float("routed_scaling_factor", 1.0, lo=0, hi=1e6, lo_open=True)

    def _groups(self, cfg) -> str:
        return (f" in the best {cfg.topk_group} of {cfg.n_group} groups"
                if cfg.n_group > 1 and cfg.topk_group < cfg.n_group else "")

    def gguf_config(self, m, raw: dict) -> None:
        from ...model.schema import relation

        n_exp = m.n_exp
        groups = m.n("expert_group_count", 1, n_exp, 1)
        relation(n_exp % groups == 0, m.where, f"{m.key('expert_count')} ({n_exp}) must be a multiple of "
                 f"{m.key('expert_group_count')} ({groups})")
        raw.update(routed_scaling_factor=m.x("expert_weights_scale", 0, 1e6, 1.0, lo_open=True),
                   norm_topk_prob=bool(m.a("expert_weights_norm", False)), n_group=groups,
                   topk_group=m.n("expert_group_used_count", 1, groups, 1), scoring_func=self.gating)

    def gguf_metadata(self, w, cfg) -> None:
        import gguf

        w.add_expert_weights_scale(float(cfg.routed_scale))
        if cfg.norm_topk_prob:
            w.add_expert_weights_norm(True)
        if cfg.n_group > 1:
            w.add_expert_group_count(cfg.n_group)
            w.add_expert_group_used_count(cfg.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(GATING[self.gating]))

    def gguf_problems(self, cfg) -> list:
        return []


@dataclass(frozen=True)
class SigmoidGrouped(_Grouped):
    """``topk_sigmoid``: sigmoid scores, plus a selection bias for the choice only, group-limited top-k (a group
    scores its top two), renormalised, scaled (DeepSeek-V3, GLM-4.5)."""

    norm_default: bool = True
    select_bias: str | None = "e_score_correction_bias"
    gating = "sigmoid"
    gguf_names = {**Softmax.gguf_names, "moe.select_bias": "blk.{i}.exp_probs_b.bias"}

    def route(self, cfg, w: dict, rt):
        op, bias = rt.op("topk_sigmoid"), rt.weight(w.get("select_bias"))  # [E] selection bias, or None
        return lambda logits: op(logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                 cfg.routed_scale)

    def describe(self, cfg) -> str:
        renorm = ", renormalised" if cfg.norm_topk_prob else " (not renormalised)"
        scaled = f", x{cfg.routed_scale:g}" if cfg.routed_scale != 1 else ""
        return (f"sigmoid with a selection bias, top-{cfg.top_k}{self._groups(cfg)} (group score: its top two)"
                f"{renorm}{scaled}")

    def gguf_config(self, m, raw: dict) -> None:
        super().gguf_config(m, raw)
        raw["topk_method"] = "noaux_tc"

    def gguf_tensors(self, g) -> dict:
        out = super().gguf_tensors(g)
        if g.n["moe.select_bias"] in g.ts.t:
            out["select_bias"] = g.ts.f32(g.n["moe.select_bias"], (g.cfg.num_experts,))
        return out


@dataclass(frozen=True)
class SoftmaxGrouped(_Grouped):
    """``topk_softmax_grouped``: softmax, group-limited top-k by each group's best expert (``topk_method``
    group_limited_greedy; greedy ignores the groups), scaled, never renormalised (DeepSeek-V2)."""

    def config(self, k, c: dict) -> None:
        super().config(k, c)
        if k.str("topk_method", "greedy", ("greedy", "group_limited_greedy")) == "greedy":
            c["n_group"] = c["topk_group"] = 1  # V2's greedy method ignores the groups

    def route(self, cfg, w: dict, rt):
        op = rt.op("topk_softmax_grouped")
        return lambda logits: op(logits, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.routed_scale)

    def describe(self, cfg) -> str:
        scaled = f", x{cfg.routed_scale:g}" if cfg.routed_scale != 1 else ""
        return f"softmax, top-{cfg.top_k}{self._groups(cfg)} (group score: its best){scaled}"

    def gguf_config(self, m, raw: dict) -> None:
        super().gguf_config(m, raw)
        raw["topk_method"] = "group_limited_greedy" if raw["n_group"] > 1 else "greedy"

    def gguf_problems(self, cfg) -> list:
        return (["grouped softmax routing (llama.cpp ranks groups by their top two, DeepSeek-V2 by their best)"]
                if cfg.n_group > 1 else [])
