"""Model configuration read from a Hugging Face ``config.json`` (both generations of keys).

transformers 4 writes ``rope_theta`` / ``rope_scaling`` / ``torch_dtype``; transformers 5 writes
``rope_parameters`` / ``dtype`` and ``head_dim: null``. Both are read into one :class:`ModelConfig`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelError
from .architectures import ARCHITECTURES, Architecture


@dataclass(frozen=True)
class ModelConfig:
    arch: Architecture
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # hd
    num_experts: int  # E
    top_k: int  # A
    expert_intermediate: int  # I (routed experts)
    dense_intermediate: int  # intermediate size of dense-MLP layers (Qwen2-MoE mlp_only_layers)
    shared_intermediate: int  # shared expert's intermediate size (0: none)
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_params: dict = field(hash=False)
    max_position_embeddings: int = 4096
    sliding_window: tuple = ()  # per layer: window size (0 = full attention)
    moe_layers: tuple = ()  # per layer: True when the MLP is a routed MoE block
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    torch_dtype: str = "float32"
    generation: dict = field(default_factory=dict, hash=False)  # generation_config.json, when present

    # ---- rotary frequencies (rope_type from the config; formulas as transformers defines them) ----------
    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """``inv_freq [hd/2]`` and the attention scaling applied to cos/sin."""
        return rope_inv_freq(self.rope_type, self.rope_theta, self.head_dim, self.rope_params, self.max_position_embeddings)


def rope_inv_freq(rope_type: str, theta: float, dim: int, p: dict, max_pos: int) -> tuple[np.ndarray, float]:
    base = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [dim/2]
    if rope_type == "default":
        return base.astype(np.float32), 1.0
    if rope_type == "linear":
        return (base / float(p["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / base
        inv = np.where(wavelen > old / lo, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, inv).astype(np.float32), 1.0
    if rope_type == "yarn":
        factor = float(p["factor"])
        old = float(p.get("original_max_position_embeddings") or max_pos)
        mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
        if p.get("attention_factor") is not None:
            attn = float(p["attention_factor"])
        elif p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
        corr = lambda n: (dim * math.log(old / (n * 2 * math.pi))) / (2 * math.log(theta))  # noqa: E731
        low, high = corr(beta_fast), corr(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv.astype(np.float32), float(attn)
    raise ModelError(f"rope type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def _rope_settings(raw: dict) -> tuple[float, str, dict]:
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    return float(theta), str(rope_type), merged


def load_config(path: str | Path) -> ModelConfig:
    """Parse ``config.json`` (a file or the directory holding it)."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise ModelError(f"{p}: no config.json")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{p}: not valid JSON ({e})") from None
    cfg = config_from_dict(raw, source=str(p))
    gen_path = p.parent / "generation_config.json"
    if gen_path.exists():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{gen_path}: not valid JSON ({e})") from None
        eos = gen.get("eos_token_id")
        extra = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        merged = tuple(dict.fromkeys(cfg.eos_token_ids + extra))  # the config's stop ids, then the generation config's
        bos = gen.get("bos_token_id", cfg.bos_token_id)
        cfg = dataclasses.replace(cfg, eos_token_ids=merged, bos_token_id=bos, generation=gen)
    return cfg


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelError(f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    try:
        get = lambda key, default=None: raw.get(key, default) if raw.get(key) is not None else default  # noqa: E731
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        n_layers = int(raw["num_hidden_layers"])
        head_dim = int(get("head_dim", hidden // heads))
        theta, rope_type, rope_params = _rope_settings(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        moe, window = arch.layer_kinds(raw, n_layers)
        return ModelConfig(
            arch=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_layers=n_layers,
            num_heads=heads, num_kv_heads=int(get("num_key_value_heads", heads)), head_dim=head_dim,
            num_experts=int(raw[arch.num_experts_key]), top_k=int(raw["num_experts_per_tok"]),
            expert_intermediate=int(raw[arch.expert_intermediate_key]),
            dense_intermediate=int(get("intermediate_size", 0)),
            shared_intermediate=int(get(arch.shared_intermediate_key, 0)) if arch.shared_intermediate_key else 0,
            norm_topk_prob=(arch.norm_topk_fixed if arch.norm_topk_fixed is not None
                            else bool(get("norm_topk_prob", arch.norm_topk_default))),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_type=rope_type,
            rope_params=rope_params, max_position_embeddings=int(get("max_position_embeddings", 4096)),
            sliding_window=window, moe_layers=moe, qkv_bias=bool(get("qkv_bias", arch.qkv_bias_default)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)), bos_token_id=get("bos_token_id"),
            eos_token_ids=eos_ids, torch_dtype=str(get("dtype", get("torch_dtype", "float32"))),
        )
    except KeyError as e:
        raise ModelError(f"{source}: missing key {e.args[0]!r} needed by {arch.name}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{source}: malformed value ({e})") from None
