"""Helpers shared by the UQFF tests (no tests here): a tiny checkpoint with a tokenizer, its bundle,
logits of a model, and rewriting a bundle's files while keeping its report consistent."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import tiny_model
from toolkit.load import load_model
from toolkit.model.safetensors_io import SafeTensorsFile, save_file
from toolkit.uqff import save_bundle, spec
from toolkit.uqff.spec import crc32_file
from toolkit.uqff.writer import write_safetensors

ROOT = Path(__file__).resolve().parents[1]
IDS = np.array([[1, 5, 9, 33, 7, 60, 2, 11]])


def _with_tokenizer(d: Path) -> Path:
    """Copy the bundled model's tokenizer files into checkpoint ``d`` (load_model and bundles carry one)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "data" / "model" / name, d / name)
    return d


def _save_checkpoint(directory: Path, config: dict, tensors: dict) -> Path:
    """config.json + model.safetensors (+ the tokenizer) in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file(tensors, d / "model.safetensors")
    return _with_tokenizer(d)


def _mlp(t: dict, p: str, D: int, I: int, r) -> None:
    """gate / up / down projections under module path ``p`` (a dense MLP, one expert or a shared expert)."""
    t |= {f"{p}.gate_proj.weight": r(I, D), f"{p}.up_proj.weight": r(I, D), f"{p}.down_proj.weight": r(D, I)}


def tiny_checkpoint(directory: Path) -> Path:
    return _with_tokenizer(tiny_model.write(Path(directory)))


def logits(model) -> np.ndarray:
    return model.forward(IDS, model.new_cache(1, IDS.shape[1]))


def reference_logits(model_dir, policy, backend="numba") -> np.ndarray:
    return logits(load_model(model_dir, backend=backend, policy=policy)[0])


def build(model_dir, out, policy, **kw) -> dict:
    return save_bundle(model_dir, out, policy, **kw)


def refresh_report(bundle: Path, name: str) -> None:
    """Record a rewritten file's new size and CRC in the report (so only the deeper checks can catch it)."""
    path = bundle / spec.REPORT
    r = json.loads(path.read_text())
    if (bundle / name).exists():
        r["files"][name] = {"bytes": (bundle / name).stat().st_size, "crc32": crc32_file(bundle / name)}
    else:
        r["files"].pop(name, None)
    path.write_text(json.dumps(r))


def read_items(path: Path) -> list[tuple[str, np.ndarray]]:
    f = SafeTensorsFile(path)
    return [(k, np.array(f.get(k))) for k in f.keys()]


def rewrite(bundle: Path, name: str, edit) -> None:
    """Rewrite one safetensors file of a bundle: ``edit(list of (name, array)) -> list``; report refreshed."""
    items = edit(read_items(bundle / name))
    write_safetensors(bundle / name, items)
    refresh_report(bundle, name)


def layer_key(bundle: Path, suffix_family: int | None = None) -> tuple[str, str]:
    """(shard file, layer key) of the first layer (of a given tag when asked)."""
    r = json.loads((bundle / spec.REPORT).read_text())
    for row in r["layers"]:
        if suffix_family is None or row["tag"] == suffix_family:
            return row["shard"], row["key"]
    raise LookupError(suffix_family)


QWEN2_MOE = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
                 moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                 num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=True, torch_dtype="float32")


def tiny_qwen2_moe(directory: Path, seed: int = 3) -> Path:
    """Shared experts with a sigmoid gate, a dense-MLP layer, q/k/v biases and tied embeddings."""
    c, rng = QWEN2_MOE, np.random.default_rng(seed)
    D, V, E, I, Is, Id = (c["hidden_size"], c["vocab_size"], c["num_experts"], c["moe_intermediate_size"],
                          c["shared_expert_intermediate_size"], c["intermediate_size"])
    hd = D // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t |= {f"{p}.input_layernorm.weight": 1 + r(D), f"{p}.post_attention_layernorm.weight": 1 + r(D),
              f"{p}.self_attn.q_proj.weight": r(q_out, D), f"{p}.self_attn.q_proj.bias": r(q_out),
              f"{p}.self_attn.k_proj.weight": r(kv_out, D), f"{p}.self_attn.k_proj.bias": r(kv_out),
              f"{p}.self_attn.v_proj.weight": r(kv_out, D), f"{p}.self_attn.v_proj.bias": r(kv_out),
              f"{p}.self_attn.o_proj.weight": r(D, q_out)}
        if i in c["mlp_only_layers"]:
            _mlp(t, f"{p}.mlp", D, Id, r)
            continue
        t |= {f"{p}.mlp.gate.weight": r(E, D), f"{p}.mlp.shared_expert_gate.weight": r(1, D)}
        _mlp(t, f"{p}.mlp.shared_expert", D, Is, r)
        for e in range(E):
            _mlp(t, f"{p}.mlp.experts.{e}", D, I, r)
    return _save_checkpoint(directory, c, t)


QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
                 moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                 mlp_only_layers=[1], num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                 attention_bias=True, tie_word_embeddings=False, torch_dtype="float32")
OLMOE = dict(architectures=["OlmoeForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=32, num_experts=4,
             num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
             clip_qkv=0.5, tie_word_embeddings=False, torch_dtype="float32")


def tiny_qk_norm_moe(directory: Path, c: dict, seed: int = 5) -> Path:
    """A Qwen3-MoE- or OLMoE-shaped checkpoint (q/k norms per head or over the projection, attention biases
    when the config asks, a dense-MLP layer for Qwen3's mlp_only_layers), written without torch."""
    rng = np.random.default_rng(seed)
    olmoe = c["architectures"] == ["OlmoeForCausalLM"]
    D, V = c["hidden_size"], c["vocab_size"]
    E = c.get("num_experts") or c["num_local_experts"]
    I = c["intermediate_size"] if olmoe else c["moe_intermediate_size"]
    H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or D // H
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        t |= {f"{p}.input_layernorm.weight": 1 + r(D), f"{p}.post_attention_layernorm.weight": 1 + r(D),
              f"{a}.q_proj.weight": r(H * hd, D), f"{a}.k_proj.weight": r(Hkv * hd, D),
              f"{a}.v_proj.weight": r(Hkv * hd, D), f"{a}.o_proj.weight": r(D, H * hd),
              f"{a}.q_norm.weight": 1 + r(H * hd if olmoe else hd), f"{a}.k_norm.weight": 1 + r(Hkv * hd if olmoe else hd)}
        if c.get("attention_bias"):
            t |= {f"{a}.q_proj.bias": r(H * hd), f"{a}.k_proj.bias": r(Hkv * hd), f"{a}.v_proj.bias": r(Hkv * hd),
                  f"{a}.o_proj.bias": r(D)}
        if i in c.get("mlp_only_layers", ()):
            _mlp(t, f"{p}.mlp", D, c["intermediate_size"], r)
            continue
        t[f"{p}.mlp.gate.weight"] = r(E, D)
        for e in range(E):
            _mlp(t, f"{p}.mlp.experts.{e}", D, I, r)
    return _save_checkpoint(directory, c, t)
