"""A tiny random Mixtral checkpoint written without torch (for error-path and quantization tests)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toolkit.model.safetensors_io import save_file

CONFIG = dict(architectures=["MixtralForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")


def tensors(cfg: dict = CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, I, V, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_local_experts"]
    hd = D // cfg["num_attention_heads"]
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t |= {f"{p}.input_layernorm.weight": 1 + r(D), f"{p}.post_attention_layernorm.weight": 1 + r(D),
              f"{p}.self_attn.q_proj.weight": r(cfg["num_attention_heads"] * hd, D),
              f"{p}.self_attn.k_proj.weight": r(cfg["num_key_value_heads"] * hd, D),
              f"{p}.self_attn.v_proj.weight": r(cfg["num_key_value_heads"] * hd, D),
              f"{p}.self_attn.o_proj.weight": r(D, cfg["num_attention_heads"] * hd),
              f"{p}.block_sparse_moe.gate.weight": r(E, D)}
        for e in range(E):
            ex = f"{p}.block_sparse_moe.experts.{e}"
            t |= {f"{ex}.w1.weight": r(I, D), f"{ex}.w3.weight": r(I, D), f"{ex}.w2.weight": r(D, I)}
    return t


def write(directory: Path, cfg: dict = CONFIG, seed: int = 0, mutate=None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    t = tensors(cfg, seed)
    if mutate:
        mutate(t)
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(t, directory / "model.safetensors")
    return directory
