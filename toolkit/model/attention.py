"""The attention parts, chosen by the architecture record (``Architecture.attention``):

- :class:`GQAAttention`: grouped-query attention ("gqa"), with optional q/k RMSNorm per head or over the
  projection ("gqa-qk-norm-head", "gqa-qk-norm-proj"), biases and clip_qkv.
- :class:`MLAAttention`: DeepSeek's multi-head latent attention ("mla"), in the absorbed form: the cache
  holds one row per token, the normed latent ``c_kv [r]`` then the rope key ``k_rope [dr]``, read as the
  key *and* the value of a single KV head.

Each takes the normed hidden states ``x [B*T, D]`` and returns the output projection ``[B*T, D]``.
Shape legend: ``N = B*T`` tokens, ``H`` heads, ``hd`` head dim; MLA: ``r`` kv_lora_rank, ``dn`` / ``dr``
the no-rope / rope parts of a query head, ``dv`` the value head dim.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError
from .config import ModelConfig
from .kv_cache import KVCache
from .linear import Linear
from .runtime import Runtime


class GQAAttention:
    def __init__(self, cfg: ModelConfig, index: int, a: dict, rt: Runtime):
        self.index, self.cfg, self.rt = index, cfg, rt
        self.qkv = _fused_qkv(a, rt)  # one product instead of three when the weights are host arrays
        self.q = self.k = self.v = None
        if self.qkv is None:
            self.q, self.k, self.v = (Linear(a[p], a.get(f"{p}_bias"), rt) for p in ("q", "k", "v"))
        self.o = Linear(a["o"], a.get("o_bias"), rt)
        self.q_norm, self.k_norm = rt.weight(a.get("q_norm")), rt.weight(a.get("k_norm"))  # [hd] or [H*hd]
        self.clip = cfg.clip_qkv
        self.sinks = rt.weight(a.get("sinks"))  # [H] gpt-oss's attention sinks, or None
        self.window = cfg.sliding_window[index]
        self.rms_norm, self.rope = rt.op("rms_norm"), rt.op("rope")
        self.rotary = cfg.rotary_dim  # 0: rope on the whole head
        if self.rotary and rt.on_device:
            raise ModelError(f"partial rotary (rope on {self.rotary} of {cfg.head_dim} head dims) runs on the numpy "
                             "and numba backends; the cuda backend does not have it yet")

    def _rope(self, x, positions, inv_freq, rope_scale):  # x [B, T, heads, hd]
        if not self.rotary:
            return self.rope(x, positions, inv_freq, rope_scale)
        x = np.array(x)  # rope on the first rotary dims, the rest passes through
        x[..., :self.rotary] = self.rope(np.ascontiguousarray(x[..., :self.rotary]), positions, inv_freq, rope_scale)
        return x

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
        q, k = self._rope(q, positions, inv_freq, rope_scale), self._rope(k, positions, inv_freq, rope_scale)
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
    The same scores and outputs as expanding every cached latent to per-head keys and values."""

    def __init__(self, cfg: ModelConfig, index: int, a: dict, rt: Runtime):
        if rt.on_device:
            raise ModelError("multi-head latent attention (DeepSeek-V2/V3) runs on the numpy and numba backends; "
                             "the cuda backend does not have it yet")
        m = self.m = cfg.mla
        self.index, self.cfg, self.rt = index, cfg, rt
        if m.q_lora_rank:
            self.q_a, self.q_a_norm = Linear(a["q_a"], a.get("q_a_bias"), rt), rt.weight(a["q_a_norm"])
            self.q = Linear(a["q_b"], None, rt)  # [H*(dn+dr), q_lora]
        else:
            self.q_a = self.q_a_norm = None
            self.q = Linear(a["q"], None, rt)  # [H*(dn+dr), D]
        self.kv_a, self.kv_a_norm = Linear(a["kv_a"], a.get("kv_a_bias"), rt), rt.weight(a["kv_a_norm"])
        kv_b = np.asarray(a["kv_b"], np.float32).reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = rt.weight(kv_b[:, :m.qk_nope_head_dim])  # [H, dn, r]
        self.w_uv = rt.weight(kv_b[:, m.qk_nope_head_dim:].transpose(0, 2, 1))  # [H, r, dv]
        self.kv_b_bytes = kv_b.nbytes
        self.o = Linear(a["o"], a.get("o_bias"), rt)
        dr = m.qk_rope_head_dim
        # interleaved rope pairs (x0, x1), (x2, x3) ... -> rotate-half order: the same rotation of q and k
        self.perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)]) if m.rope_interleave else None
        self.rms_norm, self.rope = rt.op("rms_norm"), rt.op("rope")

    def _rope(self, x, positions, inv_freq, rope_scale):  # x [N, heads, dr] -> [B, T, heads, dr]
        B, T = positions.shape
        x = x[..., self.perm] if self.perm is not None else np.ascontiguousarray(x)
        return self.rope(x.reshape(B, T, x.shape[1], x.shape[2]), positions, inv_freq, rope_scale)

    def __call__(self, x, positions, cache: KVCache, inv_freq, rope_scale):  # x [N, D] -> [N, D]
        cfg, m = self.cfg, self.m
        B, T = positions.shape
        N, H, r, dn = B * T, cfg.num_heads, m.kv_lora_rank, m.qk_nope_head_dim
        if self.q_a is not None:
            x_q = self.rms_norm(self.q_a(x), self.q_a_norm, cfg.rms_norm_eps)  # [N, q_lora]
            q = self.q(x_q).reshape(N, H, m.qk_head_dim)  # [N, H, dn + dr]
        else:
            q = self.q(x).reshape(N, H, m.qk_head_dim)
        kv = self.kv_a(x)  # [N, r + dr]
        latent = self.rms_norm(np.ascontiguousarray(kv[:, :r]), self.kv_a_norm, cfg.rms_norm_eps)  # [N, r]
        q_rope = self._rope(q[:, :, dn:], positions, inv_freq, rope_scale)  # [B, T, H, dr]
        k_rope = self._rope(kv[:, None, r:], positions, inv_freq, rope_scale)  # [B, T, 1, dr]
        q_lat = np.matmul(q[:, :, :dn].transpose(1, 0, 2), self.w_uk).transpose(1, 0, 2)  # [N, H, r]
        qf = np.concatenate([q_lat, q_rope.reshape(N, H, -1)], axis=-1).reshape(B, T, H, -1)  # [B, T, H, r + dr]
        row = np.concatenate([latent, k_rope.reshape(N, -1)], axis=-1).reshape(B, T, 1, -1)  # [B, T, 1, r + dr]
        cache.write(self.index, row, None, positions)  # one row: the key, and (its first r) the value
        att = cache.attention(self.index, qf, positions, cfg.attn_scale, 0)  # [B, T, H, r + dr]
        o_lat = att.reshape(N, H, -1)[:, :, :r].transpose(1, 0, 2)  # [H, N, r]
        out = np.matmul(o_lat, self.w_uv).transpose(1, 0, 2).reshape(N, H * m.v_head_dim)  # [N, H*dv]
        return self.o(np.ascontiguousarray(out))

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in (self.q_a, self.q, self.kv_a, self.o) if l is not None) + self.kv_b_bytes

    @property
    def norm_bytes(self) -> int:
        return sum(n.nbytes for n in (self.q_a_norm, self.kv_a_norm) if n is not None)


ATTENTION_PARTS = {"gqa": GQAAttention, "gqa-qk-norm-head": GQAAttention, "gqa-qk-norm-proj": GQAAttention,
                   "mla": MLAAttention}


def _fused_qkv(a: dict, rt: Runtime) -> Linear | None:
    """q, k and v as one ``[nq + 2 nk, D]`` product (vLLM's QKV linear): a decode step makes one call per
    layer instead of three. Only for dense weights on the CPU backends (quantized ones stay separate; on a
    device the three outputs would be strided views, which its kernels do not take)."""
    parts = [a[p] for p in ("q", "k", "v")]
    if rt.on_device or not all(isinstance(w, np.ndarray) for w in parts):
        return None
    biases = [a.get(f"{p}_bias") for p in ("q", "k", "v")]
    if any(b is not None and not isinstance(b, np.ndarray) for b in biases):
        return None
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate([np.zeros(w.shape[0], np.float32) if b is None else np.asarray(b, np.float32)
                               for w, b in zip(parts, biases)])
    return Linear(np.concatenate([np.asarray(w, np.float32) for w in parts]), bias, rt)
