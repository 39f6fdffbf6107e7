"""The attention parts' runtime classes, one per part of ``toolkit/families/parts/attention.py``:

- :class:`GQAAttention` for :class:`GQA`: grouped-query attention, with optional q/k RMSNorm per head or over the
  projection, biases, clip_qkv and sinks.
- :class:`MLAAttention` for :class:`MLA`: DeepSeek's multi-head latent attention, in the absorbed form: the cache
  holds one row per token, the normed latent ``c_kv [r]`` then the rope key ``k_rope [dr]``, read as the
  key *and* the value of a single KV head.

Each takes the normed hidden states ``x [B*T, D]`` and returns the output projection ``[B*T, D]``.
Shape legend: ``N = B*T`` tokens, ``H`` heads, ``hd`` head dim; MLA: ``r`` kv_lora_rank, ``dn`` / ``dr``
the no-rope / rope parts of a query head, ``dv`` the value head dim.
"""
from __future__ import annotations

import numpy as np

from ..families.parts.attention import GQA, MLA
from ..formats import QTensor
from ..mapped import release
from .config import ModelConfig
from .kv_cache import KVCache
from .linear import Linear
from .runtime import Runtime


class GQAAttention:
    def __init__(self, cfg: ModelConfig, index: int, a: dict, rt: Runtime):
        self.index, self.cfg, self.rt = index, cfg, rt
        self.qkv = _fused_qkv(a, rt, cfg.torch_dtype)  # one product instead of three when the weights are host arrays
        self.q = self.k = self.v = None
        if self.qkv is None:
            self.q, self.k, self.v = (Linear(a[p], a.get(f"{p}_bias"), rt) for p in ("q", "k", "v"))
        self.o = Linear(rt.dense(a["o"], cfg.torch_dtype), a.get("o_bias"), rt)  # 16-bit on numba when exact
        self.q_norm, self.k_norm = rt.weight(a.get("q_norm")), rt.weight(a.get("k_norm"))  # [hd] or [H*hd]
        self.clip = cfg.clip_qkv
        self.sinks = rt.weight(a.get("sinks"))  # [H] gpt-oss's attention sinks, or None
        self.window = cfg.sliding_window[index]
        self.rms_norm, self.rope = rt.op("rms_norm"), rt.op("rope")

    def __call__(self, x, positions, cache: KVCache, inv_freq, rope_scale):  # x [N, D] -> [N, D]
        cfg, rt = self.cfg, self.rt
        B, T = positions.shape
        if self.qkv is not None:
            nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            qkv = self.qkv(x)  # [N, nq + 2 nk]
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.q_norm is not None:  # per head (rows of hd) or over the whole projection (rows of H*hd)
            q = self.rms_norm(q.reshape(-1, self.q_norm.shape[0]), self.q_norm, cfg.rms_norm_eps)
            k = self.rms_norm(k.reshape(-1, self.k_norm.shape[0]), self.k_norm, cfg.rms_norm_eps)
        if self.clip is not None:
            q, k, v = (rt.clip(t, self.clip) for t in (q, k, v))
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)  # [B, T, H, hd]
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)  # [B, T, Hkv, hd]
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        # inv_freq [rd/2]: partial rotary (rd < hd) rotates the first rd dims of each head, the rest pass through
        q, k = self.rope(q, positions, inv_freq, rope_scale), self.rope(k, positions, inv_freq, rope_scale)
        cache.write(self.index, k, v, positions)  # quantized on write for q8_0 / q4_0 caches
        att = cache.attention(self.index, q, positions, cfg.attn_scale, self.window, self.sinks)  # [B, T, H, hd]
        return self.o(att.reshape(B * T, -1))

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in (self.qkv, self.q, self.k, self.v, self.o) if l is not None)

    @property
    def norm_bytes(self) -> int:
        return sum(n.nbytes for n in (self.q_norm, self.k_norm, self.sinks) if n is not None)


class MLAAttention:
    """Absorbed MLA: ``q_nope`` is taken through each head's key up-projection (``W_UK [H, dn, r]``) into
    the latent space, so a score is ``q_lat . c_kv + q_rope . k_rope`` over the cached row; the attention
    output in latent space goes through each head's value up-projection (``W_UV [H, r, dv]``), then o_proj.
    The same scores and outputs as expanding every cached latent to per-head keys and values. Stages, each an
    op in every backend: mla_q (query rows), mla_kv (the cached row), kv_attention over one KV head whose rows
    are keys and values, mla_out (back to per-head values)."""

    def __init__(self, cfg: ModelConfig, index: int, a: dict, rt: Runtime):
        m = self.m = cfg.mla
        self.index, self.cfg, self.rt = index, cfg, rt
        if m.q_lora_rank:
            self.q_a, self.q_a_norm = Linear(a["q_a"], a.get("q_a_bias"), rt), rt.weight(a["q_a_norm"])
            self.q = Linear(a["q_b"], None, rt)  # [H*(dn+dr), q_lora]
        else:
            self.q_a = self.q_a_norm = None
            self.q = Linear(a["q"], None, rt)  # [H*(dn+dr), D]
        self.kv_a, self.kv_a_norm = Linear(a["kv_a"], a.get("kv_a_bias"), rt), rt.weight(a["kv_a_norm"])
        kv_b = np.asarray(rt.host(a["kv_b"]), np.float32).reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = rt.weight(kv_b[:, :m.qk_nope_head_dim])  # [H, dn, r]
        self.w_uv = rt.weight(kv_b[:, m.qk_nope_head_dim:].transpose(0, 2, 1))  # [H, r, dv]
        self.kv_b_bytes = kv_b.nbytes
        self.o = Linear(a["o"], a.get("o_bias"), rt)
        self.rms_norm = rt.op("rms_norm")
        self.mla_q, self.mla_kv, self.mla_out = rt.op("mla_q"), rt.op("mla_kv"), rt.op("mla_out")

    def __call__(self, x, positions, cache: KVCache, inv_freq, rope_scale):  # x [N, D] -> [N, D]
        cfg, m = self.cfg, self.m
        q_in = self.rms_norm(self.q_a(x), self.q_a_norm, cfg.rms_norm_eps) if self.q_a is not None else x
        qf = self.mla_q(self.q(q_in), self.w_uk, positions, inv_freq, rope_scale, m.rope_interleave)  # [B, T, H, r + dr]
        row = self.mla_kv(self.kv_a(x), self.kv_a_norm, cfg.rms_norm_eps, positions, inv_freq, rope_scale,
                          m.rope_interleave)  # [B, T, 1, r + dr]
        cache.write(self.index, row, None, positions)  # one row: the key, and (its first r) the value
        att = cache.attention(self.index, qf, positions, cfg.attn_scale, 0)  # [B, T, H, r + dr]
        return self.o(self.mla_out(att, self.w_uv))  # [N, H*dv] -> [N, D]

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in (self.q_a, self.q, self.kv_a, self.o) if l is not None) + self.kv_b_bytes

    @property
    def norm_bytes(self) -> int:
        return sum(n.nbytes for n in (self.q_a_norm, self.kv_a_norm) if n is not None)


ATTENTION_PARTS = {GQA: GQAAttention, MLA: MLAAttention}  # the runtime class of each attention part


def _fused_qkv(a: dict, rt: Runtime, torch_dtype: str) -> Linear | None:
    """q, k and v as one ``[nq + 2 nk, D]`` product (vLLM's QKV linear): a decode step makes one call per
    layer instead of three. Only for dense weights on the CPU backends (quantized ones stay separate; on a
    device the three outputs would be strided views, which its kernels do not take); held in the checkpoint's
    16-bit type on numba when exact (``Runtime.dense``). Three weights that arrived 16-bit (``Runtime.placing``)
    are joined as they are, and the mapped pages of any that were views of the file handed back: the joined copy
    is what is kept."""
    parts = [a[p] for p in ("q", "k", "v")]
    if rt.on_device or not all(isinstance(w, np.ndarray) or _is16(w) for w in parts):
        return None
    biases = [a.get(f"{p}_bias") for p in ("q", "k", "v")]
    if any(b is not None and not isinstance(b, np.ndarray) for b in biases):
        return None
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate([np.zeros(w.shape[0], np.float32) if b is None else np.asarray(b, np.float32)
                               for w, b in zip(parts, biases)])
    if all(_is16(w) for w in parts) and len({w.fmt.name for w in parts}) == 1:
        stored = [w.arrays["weight"] for w in parts]
        joined = QTensor(parts[0].fmt, (sum(w.shape[0] for w in parts), parts[0].shape[1]), {"weight": np.concatenate(stored)})
        release(stored)
        return Linear(joined, bias, rt)
    f32 = [w.dequantize("numpy") if _is16(w) else np.asarray(w, np.float32) for w in parts]
    return Linear(rt.dense(np.concatenate(f32), torch_dtype), bias, rt)


def _is16(w) -> bool:
    return isinstance(w, QTensor) and not w.fmt.quantized and w.fmt.bits == 16
