"""The MoE decoder as named stages (embedding, RMSNorm, rotary, GQA attention with KV cache, router,
experts, combine, final norm, LM head), each op resolved once from ``toolkit.ops`` for one backend.

Shape legend: ``B`` sequences, ``T`` new tokens per sequence, ``D`` hidden, ``H``/``Hkv`` heads,
``hd`` head dim, ``E`` experts, ``A`` active experts per token, ``V`` vocabulary.
"""
from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..formats import QTensor
from ..formats.base import readonly
from ..ops import get_op
from .config import ModelConfig
from .kv_cache import KVCache, parse_kv_cache
from .weights import LayerWeights, ModelWeights


def _norm(w: np.ndarray) -> np.ndarray:
    """An RMSNorm weight as the kernels take it: contiguous f32, read-only (one compiled flavour)."""
    return readonly(np.ascontiguousarray(w, dtype=np.float32))


class Linear:
    """``y = x @ W.T (+ b)``: [T, in] -> [T, out]. A dense f32 weight goes to BLAS; a quantized one
    (:class:`~toolkit.formats.QTensor`) to the ``qlinear`` op of the backend, chosen here, once."""

    def __init__(self, weight, bias: np.ndarray | None = None, backend: str = "numba"):
        self.bias = bias
        if isinstance(weight, QTensor):
            self.weight = weight  # [out, in] quantized
            op = get_op("qlinear", backend)
            self._matmul = lambda x: op(np.ascontiguousarray(x, dtype=np.float32), weight)
        else:
            self.weight = np.ascontiguousarray(weight, dtype=np.float32)  # [out, in]
            self._matmul = lambda x: x @ self.weight.T

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self._matmul(x)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)


class MoEBlock:
    """Router -> routed experts (SwiGLU) -> combine, plus the shared expert with its sigmoid gate."""

    def __init__(self, cfg: ModelConfig, w: dict, backend: str, experts=None):
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        self.router = Linear(w["router"])  # [E, D]
        self.topk_softmax = get_op("topk_softmax", backend)
        self.silu_and_mul = get_op("silu_and_mul", backend)
        if experts is None and isinstance(w["gate_up"], QTensor):  # quantized experts: the grouped pipeline
            fused_moe = get_op("fused_moe", backend)
            gate_up, down = w["gate_up"], w["down"]
            experts = lambda x, ids, wts: fused_moe(x, wts, ids, gate_up, down)  # noqa: E731
            experts.nbytes = gate_up.nbytes + down.nbytes
        if experts is None:
            moe_experts = get_op("moe_experts", backend)
            gate_up, down = np.ascontiguousarray(w["gate_up"], np.float32), np.ascontiguousarray(w["down"], np.float32)
            experts = lambda x, ids, wts: moe_experts(x, ids, wts, gate_up, down)  # noqa: E731
            experts.nbytes = gate_up.nbytes + down.nbytes
        self.experts = experts
        self.shared = None
        if "shared_gate_up" in w:
            self.shared = (Linear(w["shared_gate_up"], backend=backend), Linear(w["shared_down"], backend=backend),
                           Linear(w["shared_gate"]))

    def __call__(self, x: np.ndarray) -> np.ndarray:  # [T, D] -> [T, D]
        logits = self.router(x)  # [T, E]
        weights, ids = self.topk_softmax(logits, self.top_k, self.renormalize)  # [T, A], [T, A]
        y = self.experts(x, ids, weights)  # [T, D]
        if self.shared is not None:
            gate_up, down, gate = self.shared
            s = down(self.silu_and_mul(gate_up(x)))  # [T, D]
            y = y + s / (np.float32(1) + np.exp(-gate(x)))  # sigmoid gate [T, 1]
        return y


class DenseMLP:
    def __init__(self, w: dict, backend: str):
        self.gate_up, self.down = Linear(w["gate_up"], backend=backend), Linear(w["down"], backend=backend)
        self.silu_and_mul = get_op("silu_and_mul", backend)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.down(self.silu_and_mul(self.gate_up(x)))


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, index: int, w: LayerWeights, backend: str, experts=None):
        a = w.attn
        self.index, self.cfg = index, cfg
        self.q, self.k, self.v = (Linear(a[p], a.get(f"{p}_bias"), backend) for p in ("q", "k", "v"))
        self.o = Linear(a["o"], backend=backend)
        self.attn_norm, self.ffn_norm = _norm(w.attn_norm), _norm(w.ffn_norm)
        self.window = cfg.sliding_window[index]
        self.rms_norm, self.rope = get_op("rms_norm", backend), get_op("rope", backend)
        self.ffn = MoEBlock(cfg, w.moe, backend, experts) if w.moe is not None else DenseMLP(w.mlp, backend)

    def __call__(self, h: np.ndarray, positions: np.ndarray, cache: KVCache, inv_freq, rope_scale) -> np.ndarray:
        cfg = self.cfg
        B, T, D = h.shape
        x = self.rms_norm(h.reshape(B * T, D), self.attn_norm, cfg.rms_norm_eps)  # [B*T, D]
        q = self.q(x).reshape(B, T, cfg.num_heads, cfg.head_dim)  # [B, T, H, hd]
        k = self.k(x).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)  # [B, T, Hkv, hd]
        v = self.v(x).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rope(q, positions, inv_freq, rope_scale), self.rope(k, positions, inv_freq, rope_scale)
        cache.write(self.index, k, v, positions)  # quantized on write for q8_0 / q4_0 caches
        att = cache.attention(self.index, q, positions, cfg.head_dim ** -0.5, self.window)  # [B, T, H, hd]
        h = h + self.o(att.reshape(B * T, -1)).reshape(B, T, D)
        x = self.rms_norm(h.reshape(B * T, D), self.ffn_norm, cfg.rms_norm_eps)
        return h + self.ffn(x).reshape(B, T, D)


class MoEModel:
    """A decoder-only MoE language model on one backend. ``forward`` is prefill and decode alike."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend: str = "numba", experts=None,
                 kv_cache: str | tuple | None = None):
        self.cfg, self.backend = cfg, backend
        self.kv_types = parse_kv_cache(kv_cache)
        self.embed = weights.embed  # [V, D]
        self.norm = _norm(weights.norm)
        self.lm_head = Linear(weights.lm_head)
        experts = experts or {}
        self.layers = [DecoderLayer(cfg, i, lw, backend, experts.get(i)) for i, lw in enumerate(weights.layers)]
        self.rms_norm = get_op("rms_norm", backend)
        self.inv_freq, self.rope_scale = cfg.rope_inv_freq()

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if max_len > self.cfg.max_position_embeddings:
            raise ModelError(f"a context of {max_len} tokens exceeds the model's max_position_embeddings "
                             f"({self.cfg.max_position_embeddings})")
        c = self.cfg
        return KVCache(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.kv_types, self.backend)

    def forward(self, tokens: np.ndarray, cache: KVCache, lengths: np.ndarray | None = None,
                last_only: bool = False) -> np.ndarray:
        """``tokens [B, T]`` (right-padded to T; ``lengths [B]`` valid tokens each) appended after what
        ``cache`` holds -> logits ``[B, T, V]`` (``[B, V]`` at each sequence's last token with last_only)."""
        tokens = np.asarray(tokens)
        B, T = tokens.shape
        lengths = np.full(B, T, np.int64) if lengths is None else np.asarray(lengths, np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ModelError(f"token ids must lie in [0, {self.cfg.vocab_size}); got {tokens.min()}..{tokens.max()}")
        start = cache.lens.copy()  # [B]
        if np.any(start + T > cache.max_len):
            raise ModelError(f"{int((start + T).max())} tokens exceed the cache's context of {cache.max_len}")
        positions = start[:, None] + np.arange(T)[None, :]  # [B, T]
        h = self.embed[tokens]  # [B, T, D]
        for layer in self.layers:
            h = layer(h, positions, cache, self.inv_freq, self.rope_scale)
        cache.lens = start + lengths
        if last_only:
            h = h[np.arange(B), lengths - 1][:, None]  # [B, 1, D]
        x = self.rms_norm(h.reshape(-1, h.shape[-1]), self.norm, self.cfg.rms_norm_eps)
        logits = self.lm_head(x).reshape(B, -1, self.cfg.vocab_size)  # [B, T, V]
        return logits[:, 0] if last_only else logits

    # ---- accounting ---------------------------------------------------------------------------------
    def weight_bytes(self) -> dict:
        """Bytes held by weights, split into experts / attention / other."""
        out = {"experts": 0, "attention": 0, "other": self.embed.nbytes + self.norm.nbytes + self.lm_head.nbytes}
        for layer in self.layers:
            out["attention"] += sum(l.nbytes for l in (layer.q, layer.k, layer.v, layer.o))
            out["other"] += layer.attn_norm.nbytes + layer.ffn_norm.nbytes
            ffn = layer.ffn
            if isinstance(ffn, MoEBlock):
                out["experts"] += ffn.experts.nbytes
                out["other"] += ffn.router.nbytes + (sum(l.nbytes for l in ffn.shared) if ffn.shared else 0)
            else:
                out["other"] += ffn.gate_up.nbytes + ffn.down.nbytes
        return out
