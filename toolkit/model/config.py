"""Model configuration read from a Hugging Face ``config.json`` (both generations of keys).

transformers 4 writes ``rope_theta`` / ``rope_scaling`` / ``torch_dtype``; transformers 5 writes
``rope_parameters`` / ``dtype`` and ``head_dim: null``. Both are read into one :class:`ModelConfig`.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..files import Folder, json_type
from ..families import FAMILIES, Family
from ..families.parts.attention import Latent
from .schema import Keys, relation, rope_settings


@dataclass(frozen=True)
class ModelConfig:
    family: Family  # the family's parts (toolkit/families)
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
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] (OLMoE)
    mla: Latent | None = None  # the attention part is MLA (head_dim is then the rope dim, dr)
    qk_norm: str | None = None  # "head", "proj" or None: where the attention part normalises q and k
    rotary_dim: int = 0  # rope on the first rotary_dim dims of each head (partial_rotary_factor); 0: all of hd
    expert_act: tuple | None = None  # None: SwiGLU; ("clamped_swiglu", alpha, limit) for gpt-oss's experts
    n_group: int = 1  # grouped routers: experts in n_group groups, the best topk_group groups eligible
    topk_group: int = 1
    routed_scale: float = 1.0  # routing weights multiplied by routed_scaling_factor
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    torch_dtype: str = "float32"
    generation: dict = field(default_factory=dict, hash=False)  # generation_config.json, when present

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(cached heads, cached row width, values read from the key rows): GQA caches Hkv heads of hd for K
        and for V; MLA caches one row of r + dr per token (latent, then rope key) that serves as both."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, True
        return self.num_kv_heads, self.head_dim, False

    @property
    def attn_scale(self) -> float:
        """The softmax scale: hd^-0.5, or for MLA qk_head_dim^-0.5 times yarn's mscale(factor, mscale_all_dim)^2."""
        if self.mla is None:
            return self.head_dim ** -0.5
        scale = self.mla.qk_head_dim ** -0.5
        p = self.rope_params
        if self.rope_type != "default" and p.get("mscale_all_dim") and float(p["factor"]) > 1:
            m = 0.1 * float(p["mscale_all_dim"]) * math.log(float(p["factor"])) + 1.0
            scale *= m * m
        return scale

    # ---- rotary frequencies (rope_type from the config; formulas as transformers defines them) ----------
    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """``inv_freq [hd/2]`` and the attention scaling applied to cos/sin."""
        return rope_inv_freq(self.rope_type, self.rope_theta, self.rotary_dim or self.head_dim, self.rope_params,
                             self.max_position_embeddings)


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


def load_config(path: str | Path, allow_outside: bool = False) -> ModelConfig:
    """Parse ``config.json`` (a file or the directory holding it), and ``generation_config.json`` beside it."""
    p = Path(path)
    is_file = p.name == "config.json" and not p.is_dir()
    folder = Folder(p.parent if is_file else p, allow_outside)
    name = p.name if is_file else "config.json"
    if not folder.exists(name):
        raise ModelError(f"{folder.dir / name}: no config.json")
    raw = folder.json(name)
    cfg = config_from_dict(raw, source=str(folder.dir / name))
    if folder.exists("generation_config.json"):
        where = str(folder.dir / "generation_config.json")
        gen = folder.json("generation_config.json")
        keys = Keys(gen, where)
        gen_eos = _eos_ids(keys, cfg.vocab_size, warned=_listed(raw.get("eos_token_id")))
        merged = tuple(dict.fromkeys(cfg.eos_token_ids + gen_eos))  # config's, then these
        bos = keys.ids("bos_token_id", cfg.vocab_size, single=True)
        cfg = dataclasses.replace(cfg, eos_token_ids=merged, bos_token_id=bos[0] if bos else cfg.bos_token_id,
                                  generation=gen)
    return cfg


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """Read and check every key the runtime uses (types, ranges, relations; see ``schema.py``)."""
    if not isinstance(raw, dict):
        raise ModelError(f"{source}: expected a JSON object, found {json_type(raw)}")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    family = next((FAMILIES[a] for a in archs if isinstance(a, str) and a in FAMILIES), None)
    if family is None:
        raise ModelError(f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                         f"supported: {', '.join(FAMILIES)}")
    k = Keys(raw, source)
    vocab, hidden, n_layers = k.int("vocab_size"), k.int("hidden_size"), k.int("num_hidden_layers")
    heads = k.int("num_attention_heads")
    kv_heads = k.int("num_key_value_heads", heads)
    relation(heads % kv_heads == 0, source, f"num_attention_heads ({heads}) must be a multiple of "
             f"num_key_value_heads ({kv_heads})")
    if raw.get("head_dim") is None:
        relation(hidden % heads == 0, source, f"hidden_size ({hidden}) must be a multiple of num_attention_heads "
                 f"({heads}) when head_dim is not given")
    head_dim = k.int("head_dim", hidden // heads)
    relation(head_dim % 2 == 0 and head_dim >= 2, source, f"head_dim ({head_dim}) must be even (rotary pairs)")
    c = dict(vocab_size=vocab, hidden_size=hidden, num_layers=n_layers, num_heads=heads, num_kv_heads=kv_heads,
             head_dim=head_dim, dense_intermediate=k.int("intermediate_size", 0))
    family.experts.config(k, c)  # experts first: the router's and the layers' keys are checked against their count
    family.attention.config(k, c)
    family.router.config(k, c)
    max_pos = k.int("max_position_embeddings", 4096)
    theta, rope_type, rope_params = rope_settings(k, max_pos)
    head_dim = c["head_dim"]  # (MLA: the rope dim)
    partial = rope_params.get("partial_rotary_factor")
    partial = k.float("partial_rotary_factor", 1.0, lo=0, hi=1, lo_open=True) if partial is None else partial
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ModelError(f"{source}: 'rope_parameters.partial_rotary_factor' must be a number in (0, 1], got {partial!r}")
    rotary = int(head_dim * partial)
    relation(rotary >= 2 and rotary % 2 == 0, source, f"partial_rotary_factor ({partial}) of head_dim {head_dim} "
             f"leaves {rotary} rotary dims; they must be even and at least 2")
    family.layers.config(k, c)
    eos_ids = _eos_ids(k, vocab)
    bos = k.ids("bos_token_id", vocab, single=True)
    c.pop("experts_key")
    return ModelConfig(
        family=family, **c, rms_norm_eps=k.float("rms_norm_eps", 1e-6, lo=0, hi=1, lo_open=True), rope_theta=theta,
        rope_type=rope_type, rope_params=rope_params, max_position_embeddings=max_pos,
        tie_word_embeddings=k.bool("tie_word_embeddings", False), rotary_dim=0 if rotary == head_dim else rotary,
        bos_token_id=bos[0] if bos else None, eos_token_ids=eos_ids,
        torch_dtype=k.str("dtype", None) or k.str("torch_dtype", "float32"),
    )


def _listed(v) -> list:
    return v if isinstance(v, list) else [] if v is None else [v]


def _eos_ids(k: Keys, vocab: int, warned=()) -> tuple[int, ...]:
    """``eos_token_id``: a token id or a list of them, the ids that end generation.

    An id the vocabulary cannot produce is left out, with a warning (once per id, not again for the ids in
    ``warned``): no logit can pick it, so generation never stops on it; transformers runs such checkpoints
    (OLMoE's family default, 50279, kept in checkpoints with a smaller vocabulary). Negative and non-integer
    ids are refused."""
    v = k.raw.get("eos_token_id")
    items = _listed(v)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in items):
        raise k._fail("eos_token_id", "a non-negative token id (or a list of them)", v)
    outside = [x for x in dict.fromkeys(items) if x >= vocab and x not in warned]
    if outside:
        ids = ", ".join(map(str, outside))
        warnings.warn(f"{k.source}: '{k.prefix}eos_token_id' {ids} {'is' if len(outside) == 1 else 'are'} outside "
                      f"the vocabulary (vocab_size {vocab}): the model cannot produce "
                      f"{'it' if len(outside) == 1 else 'them'}, so generation will not stop on "
                      f"{'it' if len(outside) == 1 else 'them'}", UserWarning, stacklevel=2)
    return tuple(x for x in items if x < vocab)

