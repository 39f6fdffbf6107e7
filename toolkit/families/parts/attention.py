"""Attention parts: grouped-query attention (:class:`GQA`) and DeepSeek's multi-head latent attention (:class:`MLA`).

Roles (``attn.*``, shapes ``[out, in]``): q, k, v, o and their biases, q_norm / k_norm ([hd] per head or [H*hd] over
the projection), sinks [H]; MLA: q or q_a -> q_a_norm -> q_b, kv_a (latent r, then rope key dr), kv_a_norm [r],
kv_b [H*(dn+dv), r], o [D, H*dv]. The runtime classes are ``toolkit.model.attention``'s, keyed by part type.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...gguf.names import rope_rows
from . import Part

GQA_NAMES = {"attn.q": "blk.{i}.attn_q.weight", "attn.k": "blk.{i}.attn_k.weight", "attn.v": "blk.{i}.attn_v.weight",
             "attn.o": "blk.{i}.attn_output.weight", "attn.q_bias": "blk.{i}.attn_q.bias",
             "attn.k_bias": "blk.{i}.attn_k.bias", "attn.v_bias": "blk.{i}.attn_v.bias",
             "attn.o_bias": "blk.{i}.attn_output.bias", "attn.q_norm": "blk.{i}.attn_q_norm.weight",
             "attn.k_norm": "blk.{i}.attn_k_norm.weight", "attn.sinks": "blk.{i}.attn_sinks.weight"}
MLA_NAMES = {"attn.q": "blk.{i}.attn_q.weight", "attn.o": "blk.{i}.attn_output.weight",
             "attn.q_a": "blk.{i}.attn_q_a.weight", "attn.q_a_norm": "blk.{i}.attn_q_a_norm.weight",
             "attn.q_b": "blk.{i}.attn_q_b.weight", "attn.kv_a": "blk.{i}.attn_kv_a_mqa.weight",
             "attn.kv_a_norm": "blk.{i}.attn_kv_a_norm.weight", "attn.k_b": "blk.{i}.attn_k_b.weight",
             "attn.v_b": "blk.{i}.attn_v_b.weight", "attn.kv_b": "blk.{i}.attn_kv_b.weight"}


@dataclass(frozen=True)
class GQA(Part):
    """Grouped-query attention with rope. ``qk_norm``: "head" (an RMSNorm over each head's q and k, Qwen3-MoE) or
    "proj" (over the whole projections, OLMoE), or switched by the config key ``qk_norm_key`` (per head, GLM-4.5);
    biases on q/k/v (and o with ``o_bias``) when ``bias_key`` says so; q, k, v clamped to [-c, c] after the norms when
    ``clip_key`` sets c; ``sinks``: one learned logit per head in the softmax denominator (gpt-oss). GGUF:
    ``gguf_rope_pairs`` (q/k rows in GGML's adjacent-pair order, llama), ``gguf_biases`` (llama.cpp reads the
    biases), ``gguf_partial_rotary`` (rope on the first ``rope.dimension_count`` dims of a head)."""

    bias_key: str = "qkv_bias"
    bias_default: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    qk_norm_key: str | None = None
    clip_key: str | None = None
    sinks: bool = False
    gguf_rope_pairs: bool = False
    gguf_biases: bool = False
    gguf_partial_rotary: bool = False
    # the projections' roles (attn.<r>) held in the checkpoint's 16-bit type on numba when exact, from the load on
    # (Runtime.placing, Runtime.dense; moqe info's estimate counts them so)
    dense16 = ("q", "k", "v", "o")

    @property
    def compiled(self) -> bool:  # the compiled decode step has no attention sinks
        return not self.sinks
    head_dim_from_hidden = True  # a GGUF without key_length: head dim = hidden / heads
    gguf_names = GQA_NAMES

    def config(self, k, c: dict) -> None:
        c["qk_norm"] = self.qk_norm or ("head" if self.qk_norm_key and k.bool(self.qk_norm_key, False) else None)
        c["qkv_bias"] = k.bool(self.bias_key, self.bias_default)
        c["clip_qkv"] = k.float(self.clip_key, None, lo=0, lo_open=True) if self.clip_key else None

    def hf_tensors(self, t):
        cfg, p, get = t.cfg, f"{t.p}.self_attn", t.get
        D, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        for proj, out_dim, in_dim in (("q", H * hd, D), ("k", Hkv * hd, D), ("v", Hkv * hd, D), ("o", D, H * hd)):
            n = f"{p}.{proj}_proj"
            yield f"attn.{proj}", f"{n}.weight", (lambda n=n: get(f"{n}.weight")), (out_dim, in_dim)
            if cfg.qkv_bias and (proj != "o" or self.o_bias):
                yield f"attn.{proj}_bias", f"{n}.bias", (lambda n=n: get(f"{n}.bias")), (out_dim,)
        if self.sinks:
            yield "attn.sinks", f"{p}.sinks", lambda: get(f"{p}.sinks"), (H,)
        if cfg.qk_norm:  # q_norm / k_norm: over one head's hd, or over the whole projection
            for proj, heads in (("q", H), ("k", Hkv)):
                n = f"{p}.{proj}_norm.weight"
                yield f"attn.{proj}_norm", n, (lambda n=n: get(n)), (hd if cfg.qk_norm == "head" else heads * hd,)

    def describe(self, cfg) -> str:
        s = "GQA" + {"head": ", RMSNorm on each head's q and k",
                     "proj": ", RMSNorm on the whole q and k projections"}.get(cfg.qk_norm, "")
        if cfg.qkv_bias:
            s += ", q/k/v" + ("/o" if self.o_bias else "") + " biases"
        if self.sinks:
            s += ", attention sinks"
        if cfg.clip_qkv is not None:
            s += f", q/k/v clipped to +-{cfg.clip_qkv:g}"
        return s

    def parameters(self, cfg) -> int:
        D, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        n = 2 * H * hd * D + 2 * Hkv * hd * D
        if cfg.qkv_bias:
            n += (H + 2 * Hkv) * hd + (D if self.o_bias else 0)
        if self.sinks:
            n += H
        if cfg.qk_norm:
            n += 2 * hd if cfg.qk_norm == "head" else (H + Hkv) * hd
        return n * cfg.num_layers

    # ---- GGUF ----
    def gguf_config(self, m, raw: dict) -> None:
        raw[self.bias_key] = "blk.0.attn_q.bias" in m.tensors
        if self.clip_key:
            clamp = m.x("attention.clamp_kqv", 0, 1e6, 0.0)
            if clamp:
                raw[self.clip_key] = clamp
        if self.gguf_partial_rotary:
            raw["partial_rotary_factor"] = m.n("rope.dimension_count", 2, raw["head_dim"]) / raw["head_dim"]
        if self.qk_norm_key:
            raw[self.qk_norm_key] = "blk.0.attn_q_norm.weight" in m.tensors

    def gguf_metadata(self, w, cfg) -> None:
        if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)

    def gguf_problems(self, cfg) -> list:
        return [what for what, bad in (("partial rotary", cfg.rotary_dim and not self.gguf_partial_rotary),
                                       ("biases on q/k/v", cfg.qkv_bias and not self.gguf_biases),
                                       ("clip_qkv", cfg.clip_qkv is not None)) if bad]

    def gguf_tensors(self, g) -> dict:
        cfg, n, keep, i, ts = g.cfg, g.n, g.keep, g.i, g.ts
        D, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        back = (lambda h: (lambda w: rope_rows(w, h, inverse=True))) if self.gguf_rope_pairs else (lambda h: None)
        a = {"q": keep("attn.q", n["attn.q"], (H * hd, D), i, back(H)),
             "k": keep("attn.k", n["attn.k"], (Hkv * hd, D), i, back(Hkv)),
             "v": keep("attn.v", n["attn.v"], (Hkv * hd, D), i),
             "o": keep("attn.o", n["attn.o"], (D, H * hd), i)}
        if cfg.qkv_bias:
            for p, rows in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd), ("o", D)):
                if p != "o" or self.o_bias and n["attn.o_bias"] in ts.t:
                    a[f"{p}_bias"] = ts.f32(n[f"attn.{p}_bias"], (rows,))
        if self.sinks:
            a["sinks"] = ts.f32(n["attn.sinks"], (H,))
        if cfg.qk_norm:
            for p, heads in (("q", H), ("k", Hkv)):
                a[f"{p}_norm"] = ts.f32(n[f"attn.{p}_norm"], (hd if cfg.qk_norm == "head" else heads * hd,))
        return a

    def gguf_weights(self, cfg, n: dict, a: dict):
        qk = (lambda w, h: rope_rows(w, h)) if self.gguf_rope_pairs else (lambda w, h: w)
        yield n["attn.q"], qk(a["q"], cfg.num_heads)
        yield n["attn.k"], qk(a["k"], cfg.num_kv_heads)
        yield n["attn.v"], a["v"]
        yield n["attn.o"], a["o"]
        for role in ("q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm", "sinks"):
            if role in a:
                yield n[f"attn.{role}"], a[role]


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's dimensions (DeepSeek-V2/V3)."""

    q_lora_rank: int  # 0: q is one projection (q_proj), else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int  # r: the latent each token keeps in the cache
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr: the rope key, shared by all heads, cached next to the latent
    v_head_dim: int  # dv
    rope_interleave: bool  # the checkpoint's rope dims are interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLA(Part):
    """DeepSeek's multi-head latent attention, run absorbed: the cache holds one compressed latent plus the rope
    key per token. GGUF (llama.cpp's deepseek2): written as MQA, kv_b split per head into ``attn_k_b [H, r, dn]``
    (transposed) and ``attn_v_b [H, dv, r]`` (old files: one ``attn_kv_b``), rope on adjacent pairs as stored."""

    bias_key: str = "attention_bias"
    o_bias: bool = True
    qk_norm = None
    sinks = False
    dense16 = ()
    compiled = False  # the compiled decode step runs GQA only
    head_dim_from_hidden = False
    gguf_names = MLA_NAMES

    def config(self, k, c: dict) -> None:
        from ...model.schema import relation

        q_rank = k.int("q_lora_rank", None, lo=1, hi=1 << 16)
        dr = k.int("qk_rope_head_dim", lo=2, hi=1024)
        relation(dr % 2 == 0, k.source, f"qk_rope_head_dim ({dr}) must be even (rotary pairs)")
        c["mla"] = Latent(q_lora_rank=q_rank or 0, kv_lora_rank=k.int("kv_lora_rank", lo=1, hi=1 << 16),
                          qk_nope_head_dim=k.int("qk_nope_head_dim", lo=0, hi=1024), qk_rope_head_dim=dr,
                          v_head_dim=k.int("v_head_dim", lo=1, hi=1024), rope_interleave=k.bool("rope_interleave", True))
        c["head_dim"] = dr  # the rope dim: what the rotary frequencies are built for
        c["qkv_bias"] = k.bool(self.bias_key, False)

    def hf_tensors(self, t):
        cfg, get = t.cfg, t.get
        m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
        n, bias = f"{t.p}.self_attn", cfg.qkv_bias
        rows = [("kv_a", "kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, D, bias),
                ("kv_b", "kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False),
                ("o", "o_proj", D, H * m.v_head_dim, bias and self.o_bias)]
        if m.q_lora_rank:
            rows = [("q_a", "q_a_proj", m.q_lora_rank, D, bias), ("q_b", "q_b_proj", H * m.qk_head_dim, m.q_lora_rank, False)] + rows
        else:
            rows = [("q", "q_proj", H * m.qk_head_dim, D, False)] + rows
        for role, module, out_dim, in_dim, has_bias in rows:
            yield f"attn.{role}", f"{n}.{module}.weight", (lambda w=f"{n}.{module}.weight": get(w)), (out_dim, in_dim)
            if has_bias:
                yield f"attn.{role}_bias", f"{n}.{module}.bias", (lambda b=f"{n}.{module}.bias": get(b)), (out_dim,)
        norms = [("kv_a_norm", "kv_a_layernorm", m.kv_lora_rank)] + ([("q_a_norm", "q_a_layernorm", m.q_lora_rank)] if m.q_lora_rank else [])
        for role, module, dim in norms:
            yield f"attn.{role}", f"{n}.{module}.weight", (lambda w=f"{n}.{module}.weight": get(w)), (dim,)

    def describe(self, cfg) -> str:
        m = cfg.mla
        s = (f"MLA (absorbed): {cfg.num_heads} heads of {m.qk_nope_head_dim} + rope {m.qk_rope_head_dim}, values "
             f"{m.v_head_dim}; q {f'low-rank {m.q_lora_rank}' if m.q_lora_rank else 'one projection'}; "
             f"the cache keeps latent {m.kv_lora_rank} + rope key {m.qk_rope_head_dim} per token"
             + (", rope pairs interleaved" if m.rope_interleave else ""))
        return s + (", q/k/v" + ("/o" if self.o_bias else "") + " biases" if cfg.qkv_bias else "")

    def parameters(self, cfg) -> int:
        m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
        q = m.q_lora_rank * (D + H * m.qk_head_dim) if m.q_lora_rank else D * H * m.qk_head_dim
        kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        return (q + kv + H * m.v_head_dim * D + m.q_lora_rank + m.kv_lora_rank) * cfg.num_layers

    # ---- GGUF ----
    def gguf_config(self, m, raw: dict) -> None:
        dr, q_rank = m.n("rope.dimension_count", 2, 1024), m.n("attention.q_lora_rank", 0, 1 << 16, 0)
        raw.update(num_key_value_heads=raw["num_attention_heads"], kv_lora_rank=m.n("attention.kv_lora_rank", 1, 1 << 16),
                   qk_rope_head_dim=dr, qk_nope_head_dim=m.n("attention.key_length_mla", dr, dr + 1024) - dr,
                   v_head_dim=m.n("attention.value_length_mla", 1, 1024), rope_interleave=True)
        raw[self.bias_key] = "blk.0.attn_q.bias" in m.tensors
        if q_rank:
            raw["q_lora_rank"] = q_rank

    def gguf_metadata(self, w, cfg) -> None:
        m = cfg.mla
        w.add_q_lora_rank(m.q_lora_rank)  # 0: q in one projection (llama.cpp requires the key unless the layer
        # count is a "lite" model's, so it is written even where the converter leaves it out)
        w.add_kv_lora_rank(m.kv_lora_rank)
        w.add_key_length(m.kv_lora_rank + m.qk_rope_head_dim)
        w.add_value_length(m.kv_lora_rank)
        w.add_key_length_mla(m.qk_nope_head_dim + m.qk_rope_head_dim)
        w.add_value_length_mla(m.v_head_dim)

    def gguf_problems(self, cfg) -> list:
        return [what for what, bad in (("partial rotary", cfg.rotary_dim), ("biases on q/k/v", cfg.qkv_bias)) if bad]

    def gguf_tensors(self, g) -> dict:
        """``kv_b [H*(dn+dv), r]`` rebuilt from llama.cpp's per-head ``k_b [H, r, dn]`` (transposed) and
        ``v_b [H, dv, r]`` (or read from an old file's single ``attn_kv_b``)."""
        cfg, n, keep, i, ts = g.cfg, g.n, g.keep, g.i, g.ts
        m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
        r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        a = {}
        if m.q_lora_rank:
            a["q_a"] = keep("attn.q_a", n["attn.q_a"], (m.q_lora_rank, D), i)
            a["q_a_norm"] = ts.f32(n["attn.q_a_norm"], (m.q_lora_rank,))
            a["q_b"] = keep("attn.q_b", n["attn.q_b"], (H * (dn + dr), m.q_lora_rank), i)
        else:
            a["q"] = keep("attn.q", n["attn.q"], (H * (dn + dr), D), i)
        a["kv_a"] = keep("attn.kv_a", n["attn.kv_a"], (r + dr, D), i)
        a["kv_a_norm"] = ts.f32(n["attn.kv_a_norm"], (r,))
        if n["attn.kv_b"] in ts.t:
            a["kv_b"] = keep("attn.kv_b", n["attn.kv_b"], (H * (dn + dv), r), i, stored=False)
        else:
            def kv_b():
                kb, vb = ts.f32(n["attn.k_b"], (H, r, dn)), ts.f32(n["attn.v_b"], (H, dv, r))
                return np.concatenate([kb.transpose(0, 2, 1), vb], axis=1).reshape(H * (dn + dv), r)

            a["kv_b"] = keep("attn.kv_b", f"{n['attn.k_b']}+{n['attn.v_b']}", (H * (dn + dv), r), i, load=kv_b)
        a["o"] = keep("attn.o", n["attn.o"], (D, H * dv), i)
        return a

    def gguf_weights(self, cfg, n: dict, a: dict):
        from ...errors import ModelError
        from ...formats import QTensor

        m, H = cfg.mla, cfg.num_heads
        if m.q_lora_rank:
            yield n["attn.q_a"], a["q_a"]
            yield n["attn.q_a_norm"], a["q_a_norm"]
            yield n["attn.q_b"], a["q_b"]
        else:
            yield n["attn.q"], a["q"]
        yield n["attn.kv_a"], a["kv_a"]
        yield n["attn.kv_a_norm"], a["kv_a_norm"]
        if isinstance(a["kv_b"], QTensor):
            raise ModelError(f"{n['attn.k_b']}: GGUF export keeps MLA's kv_b in full precision (llama.cpp splits it per "
                             f"head); leave it out of the policy")
        kv_b = np.asarray(a["kv_b"], np.float32).reshape(H, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        yield n["attn.k_b"], np.ascontiguousarray(kv_b[:, :m.qk_nope_head_dim].transpose(0, 2, 1))
        yield n["attn.v_b"], np.ascontiguousarray(kv_b[:, m.qk_nope_head_dim:])
        yield n["attn.o"], a["o"]

