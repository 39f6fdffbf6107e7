"""Layer parts: which layers are routed MoE blocks and which are dense MLPs, which slide and how far, and the
per-layer norms. Roles: ``attn_norm [D]``, ``ffn_norm [D]``, dense layers' ``mlp.gate_up [2I, D]``, ``mlp.down [D, I]``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ModelError
from . import Part, limit
from .loading import cat

NORM_NAMES = {"attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
              "mlp.gate": "blk.{i}.ffn_gate.weight", "mlp.up": "blk.{i}.ffn_up.weight", "mlp.down": "blk.{i}.ffn_down.weight"}


@dataclass(frozen=True)
class AllMoE(Part):
    """Every layer routed; one sliding window (``sliding_window``, 0 = full attention) for all. GGUF:
    ``gguf_ffn_norm`` is the FFN norm's name; ``gguf_swa_pattern`` n: layer i slides when i % n < n - 1 (llama.cpp's
    pattern; 0: no sliding layers)."""

    gguf_ffn_norm: str = "blk.{i}.ffn_norm.weight"
    gguf_swa_pattern: int = 0

    @property
    def gguf_names(self) -> dict:
        return {**NORM_NAMES, "ffn_norm": self.gguf_ffn_norm}

    def kinds(self, k, n_layers: int, n_experts: int) -> tuple[tuple, tuple]:
        """(is MoE per layer, sliding window per layer)."""
        window = k.int("sliding_window", 0)
        return (True,) * n_layers, (window,) * n_layers

    def config(self, k, c: dict) -> None:
        from ...model.schema import relation

        c["moe_layers"], c["sliding_window"] = self.kinds(k, c["num_layers"], c["num_experts"])
        relation(all(c["moe_layers"]) or c["dense_intermediate"] >= 1, k.source,
                 "dense MLP layers need intermediate_size >= 1")

    def hf_norms(self, t):
        p, get, D = t.p, t.get, t.cfg.hidden_size
        yield "attn_norm", f"{p}.input_layernorm.weight", lambda: get(f"{p}.input_layernorm.weight"), (D,)
        yield "ffn_norm", f"{p}.post_attention_layernorm.weight", lambda: get(f"{p}.post_attention_layernorm.weight"), (D,)

    def hf_mlp(self, t):
        n, get, D, I = f"{t.p}.mlp", t.get, t.cfg.hidden_size, t.cfg.dense_intermediate
        yield "mlp.gate_up", f"{n}.gate_proj+up_proj", (lambda: cat(get, [f"{n}.gate_proj.weight", f"{n}.up_proj.weight"], (I, D))), (2 * I, D)
        yield "mlp.down", f"{n}.down_proj.weight", lambda: get(f"{n}.down_proj.weight"), (D, I)

    def describe(self, cfg) -> str:
        dense = [i for i, m in enumerate(cfg.moe_layers) if not m]
        return f"{sum(cfg.moe_layers)} MoE" + (f", dense MLP at {dense}" if dense else "")

    def parameters(self, cfg) -> int:
        """The norms and the dense MLP layers."""
        return 2 * cfg.hidden_size * cfg.num_layers + (cfg.num_layers - sum(cfg.moe_layers)) * 3 * cfg.dense_intermediate * cfg.hidden_size

    # ---- GGUF ----
    def _swa(self, cfg) -> tuple:
        m = self.gguf_swa_pattern
        return tuple(cfg.sliding_window[0] if i % m < m - 1 else 0 for i in range(cfg.num_layers)) if m and cfg.sliding_window else ()

    def _dense_ok(self, cfg) -> bool:
        return all(cfg.moe_layers)

    def gguf_config(self, m, raw: dict) -> None:
        if self.gguf_swa_pattern:  # llama.cpp's pattern: layer i slides when i % n < n - 1
            n = self.gguf_swa_pattern
            raw["sliding_window"] = m.n("attention.sliding_window", *limit("sliding_window"))
            raw["layer_types"] = ["sliding_attention" if i % n < n - 1 else "full_attention"
                                  for i in range(raw["num_hidden_layers"])]

    def gguf_metadata(self, w, cfg) -> None:
        if self.gguf_swa_pattern:
            w.add_sliding_window(max(cfg.sliding_window) if any(cfg.sliding_window) else cfg.max_position_embeddings)

    def gguf_problems(self, cfg) -> list:
        return [what for what, bad in (
            ("a sliding window", any(cfg.sliding_window) and tuple(cfg.sliding_window) != self._swa(cfg)),
            ("dense MLP layers", not self._dense_ok(cfg))) if bad]


@dataclass(frozen=True)
class SparseStep(AllMoE):
    """Qwen2-MoE's layer keys: dense MLPs at ``mlp_only_layers`` and off the ``decoder_sparse_step``; sliding layers
    by ``layer_types``, or from ``max_window_layers`` on when ``use_sliding_window`` is set."""

    def kinds(self, k, n_layers: int, n_experts: int) -> tuple[tuple, tuple]:
        only_mlp = set(k.int_list("mlp_only_layers", 0, n_layers - 1))
        step = k.int("decoder_sparse_step", 1)
        moe = tuple(i not in only_mlp and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))
        window = k.int("sliding_window", 0)
        types = k.str_list("layer_types", ("full_attention", "sliding_attention"))
        if types:
            if len(types) < n_layers:
                raise ModelError(f"{k.source}: 'layer_types' lists {len(types)} layers, num_hidden_layers is {n_layers}")
            windows = tuple(window if t == "sliding_attention" else 0 for t in types[:n_layers])
        elif k.bool("use_sliding_window", False):
            first = k.int("max_window_layers", 0)
            windows = tuple(window if i >= first else 0 for i in range(n_layers))
        else:
            windows = (0,) * n_layers
        return moe, windows


@dataclass(frozen=True)
class LeadingDense(AllMoE):
    """DeepSeek's: dense MLPs in the first ``first_k_dense_replace`` layers, then a routed block every
    ``moe_layer_freq`` layers (1 in every released model); full attention everywhere. GGUF:
    ``leading_dense_block_count``."""

    def kinds(self, k, n_layers: int, n_experts: int) -> tuple[tuple, tuple]:
        first, freq = k.int("first_k_dense_replace", 0, lo=0, hi=n_layers), k.int("moe_layer_freq", 1, lo=1, hi=1024)
        moe = tuple(n_experts > 0 and i >= first and i % freq == 0 for i in range(n_layers))
        return moe, (0,) * n_layers

    def _dense_ok(self, cfg) -> bool:
        lead = cfg.moe_layers.index(True) if True in cfg.moe_layers else cfg.num_layers
        return all(cfg.moe_layers[lead:])

    def gguf_config(self, m, raw: dict) -> None:
        super().gguf_config(m, raw)
        raw["first_k_dense_replace"] = m.n("leading_dense_block_count", 0, raw["num_hidden_layers"], 0)
        raw["intermediate_size"] = m.n("feed_forward_length", *limit("intermediate_size"), raw[m.expert_size_key])

    def gguf_metadata(self, w, cfg) -> None:
        super().gguf_metadata(w, cfg)
        w.add_leading_dense_block_count(cfg.moe_layers.index(True))
