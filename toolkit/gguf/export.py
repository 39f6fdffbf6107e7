"""``moqe export --gguf OUT.gguf``: a checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2/V3,
GLM-4.5), quantized by a policy,
written as the GGUF file llama.cpp's converter would write (names and hyperparameters: ``names.py``;
tokenizer: ``tokenizer.py``).

Weights in a GGML type are written as stored: q8_0 / q4_0 / mxfp4 blocks are GGML's bytes, so the policy's
blocks go in unchanged. Unquantized 2-D and 3-D weights are written in f16 when the checkpoint is f16 and
f16 holds them exactly, else f32; norms in f32 (as the converter does). A format GGML has no type for
(int8, int4, int3, int2, fp8) is refused, naming the weight. The file is written next to ``OUT`` and renamed
onto it when complete: a failed export leaves nothing behind.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import FormatError, ModelError
from ..formats import QTensor
from ..formats.mixed import MixedExperts
from ..uqff.keys import split_rows
from .names import BY_HF, GLOBAL, OAI_SWIGLU, YARN_TRUNCATE, layer_names, rope_rows


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ModelError("GGUF needs the 'gguf' package: pip install gguf") from None
    return gguf


def _tensor(gguf, name: str, w, f16: bool):
    """(array, raw GGML type or None) for the writer: a QTensor's stored bytes, or a dense array."""
    if isinstance(w, QTensor):
        if w.fmt.ggml_type is None:
            from ..formats import FORMATS

            have = ", ".join(f.name for f in FORMATS.values() if f.ggml_type is not None and f.quantized)
            raise ModelError(f"weight {name!r} is {w.fmt.spec}, which GGUF has no type for; GGUF export takes "
                             f"{have} (or none) for quantized weights")
        a = next(iter(w.arrays.values()))
        if not w.fmt.quantized:  # f16 / bf16 kept in the checkpoint's type
            return (a if a.dtype == np.float16 else a.view(np.uint16)), (None if a.dtype == np.float16 else
                                                                          gguf.GGMLQuantizationType.BF16)
        return np.ascontiguousarray(a), gguf.GGMLQuantizationType(w.fmt.ggml_type)
    a = np.ascontiguousarray(w, np.float32)
    if f16 and a.ndim >= 2:
        h = a.astype(np.float16)
        if np.array_equal(h.astype(np.float32), a):
            return h, None
    return a, None


def arch_for(cfg):
    """The GGUF architecture record of a config, or a ModelError saying what GGUF export takes."""
    arch = BY_HF.get(cfg.arch.name)
    if arch is None:
        raise ModelError(f"GGUF export takes {', '.join(BY_HF)}; this model is {cfg.arch.name}")
    swa = tuple(cfg.sliding_window[0] if i % arch.swa_pattern < arch.swa_pattern - 1 else 0
                for i in range(cfg.num_layers)) if arch.swa_pattern and cfg.sliding_window else ()
    lead = cfg.moe_layers.index(True) if True in cfg.moe_layers else cfg.num_layers
    p = cfg.rope_params
    yarn_ok = cfg.rope_type == "yarn" and (arch.gguf == "gpt-oss" or arch.gguf == "deepseek2" and
                                           p.get("mscale", 1.0) == p.get("mscale_all_dim", 1.0))
    problems = [what for what, bad in (
        ("rope scaling", cfg.rope_type != "default" and not yarn_ok),
        ("a sliding window", any(cfg.sliding_window) and tuple(cfg.sliding_window) != swa),
        ("dense MLP layers", not all(cfg.moe_layers) and (arch.gguf not in ("deepseek2", "glm4moe")
                                                          or not all(cfg.moe_layers[lead:]))),
        ("partial rotary", cfg.rotary_dim and arch.gguf != "glm4moe"),
        ("top-k renormalisation other than llama.cpp's for this architecture",
         arch.norm_topk is not None and cfg.norm_topk_prob != arch.norm_topk),
        ("biases on q/k/v", cfg.qkv_bias and not arch.qkv_bias), ("clip_qkv", cfg.clip_qkv is not None),
        ("a clamped SwiGLU other than alpha 1.702, limit 7", cfg.expert_act is not None and
         tuple(float(v) for v in cfg.expert_act[1:]) != OAI_SWIGLU),
        ("grouped softmax routing (llama.cpp ranks groups by their top two, DeepSeek-V2 by their best)",
         cfg.arch.router == "softmax-grouped" and cfg.n_group > 1))
        if bad]
    if problems:
        raise ModelError(f"GGUF export: this {cfg.arch.name} has {', '.join(problems)}, which llama.cpp's "
                         f"{arch.gguf} architecture does not run")
    return arch


def _metadata(writer, cfg, arch, name: str) -> None:
    writer.add_name(name)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.dense_intermediate if arch.expert_ff and cfg.dense_intermediate
                                   else cfg.expert_intermediate)
    if arch.expert_ff:
        writer.add_expert_feed_forward_length(cfg.expert_intermediate)
    if cfg.shared_intermediate and cfg.mla is None:
        writer.add_expert_shared_feed_forward_length(cfg.shared_intermediate)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(1 if cfg.mla is not None else cfg.num_kv_heads)  # MLA as MQA, as the converter says
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    if arch.gguf == "deepseek2":
        _deepseek2_metadata(writer, cfg)
    elif arch.gguf == "glm4moe":
        _routing_metadata(writer, cfg)
    elif cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch.swa_pattern:
        writer.add_sliding_window(max(cfg.sliding_window) if any(cfg.sliding_window) else cfg.max_position_embeddings)
    if cfg.rope_type == "yarn":  # as llama.cpp's converter writes it, plus ours: whether the range is rounded
        p = cfg.rope_params
        writer.add_rope_scaling_type(_gguf().RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(p["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(p.get("original_max_position_embeddings") or cfg.max_position_embeddings))
        for k, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if p.get(k) is not None:
                add(float(p[k]))
        if arch.gguf == "gpt-oss":
            writer.add_bool(f"{arch.gguf}.{YARN_TRUNCATE}", bool(p.get("truncate", True)))
        if p.get("mscale_all_dim"):  # DeepSeek: llama.cpp's 0.1 * mscale_all_dim (its mscale equal to it)
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(p["mscale_all_dim"]))


def _deepseek2_metadata(writer, cfg) -> None:
    """The deepseek2.* keys llama.cpp's converter writes: MLA ranks and head sizes (as MQA), leading dense layers,
    shared experts, routing (gating function, groups, scale, renormalisation)."""
    m = cfg.mla
    writer.add_leading_dense_block_count(cfg.moe_layers.index(True))
    writer.add_q_lora_rank(m.q_lora_rank)  # 0: q in one projection (llama.cpp requires the key unless the layer
    # count is a "lite" model's, so it is written even where the converter leaves it out)
    writer.add_kv_lora_rank(m.kv_lora_rank)
    writer.add_key_length(m.kv_lora_rank + m.qk_rope_head_dim)
    writer.add_value_length(m.kv_lora_rank)
    writer.add_key_length_mla(m.qk_nope_head_dim + m.qk_rope_head_dim)
    writer.add_value_length_mla(m.v_head_dim)
    _routing_metadata(writer, cfg)


def _routing_metadata(writer, cfg) -> None:
    """DeepSeek-V3-style MoE keys (deepseek2, glm4moe)."""
    if cfg.mla is None:
        writer.add_leading_dense_block_count(cfg.moe_layers.index(True))
        if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
            writer.add_key_length(cfg.head_dim)
            writer.add_value_length(cfg.head_dim)
    writer.add_expert_shared_count(cfg.shared_intermediate // cfg.expert_intermediate)
    writer.add_expert_weights_scale(float(cfg.routed_scale))
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if cfg.n_group > 1:
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    gating = _gguf().ExpertGatingFuncType
    writer.add_expert_gating_func(gating.SIGMOID if cfg.arch.router == "sigmoid-grouped" else gating.SOFTMAX)


def _weights(cfg, arch, weights):
    """(GGUF name, weight) in the converter's order: embeddings, layers, final norm, head."""
    yield GLOBAL["embed"], weights.embed
    qk = (lambda w, h: rope_rows(w, h)) if arch.rope_pairs else (lambda w, h: w)
    for i, lw in enumerate(weights.layers):
        n = layer_names(arch, i)
        a, m = lw.attn, lw.moe
        yield n["attn_norm"], lw.attn_norm
        if cfg.mla is not None:
            yield from _mla_weights(cfg, n, a)
        else:
            yield n["attn.q"], qk(a["q"], cfg.num_heads)
            yield n["attn.k"], qk(a["k"], cfg.num_kv_heads)
            yield n["attn.v"], a["v"]
            yield n["attn.o"], a["o"]
        for role in ("q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm", "sinks"):
            if role in a:
                yield n[f"attn.{role}"], a[role]
        yield n["ffn_norm"], lw.ffn_norm
        if m is None:  # a dense MLP layer
            gate, up = split_rows(lw.mlp["gate_up"], 2)
            yield n["mlp.gate"], gate
            yield n["mlp.up"], up
            yield n["mlp.down"], lw.mlp["down"]
            continue
        yield n["moe.router"], m["router"]
        if "select_bias" in m:
            yield n["moe.select_bias"], m["select_bias"]
        if "router_bias" in m:
            yield n["moe.router_bias"], m["router_bias"]
        if any(isinstance(m[k], MixedExperts) for k in ("gate_up", "down")):
            mixed = next(m[k] for k in ("gate_up", "down") if isinstance(m[k], MixedExperts))
            raise FormatError(f"layer {i}: its experts are stored at mixed widths ({mixed.label}); GGUF holds a "
                              f"layer's experts in one tensor of one type: save a UQFF bundle instead")
        gate, up = split_rows(m["gate_up"], 2)  # [E, 2I, D] -> [E, I, D] x 2
        yield n["moe.gate"], gate
        yield n["moe.up"], up
        yield n["moe.down"], m["down"]
        if "gate_up_bias" in m:  # [E, 2I] -> gate [E, I], up [E, I]
            b = np.asarray(m["gate_up_bias"], np.float32)
            yield n["moe.gate_bias"], b[:, :b.shape[1] // 2]
            yield n["moe.up_bias"], b[:, b.shape[1] // 2:]
            yield n["moe.down_bias"], m["down_bias"]
        if "shared_gate_up" in m:
            sg, su = split_rows(m["shared_gate_up"], 2)
            yield n["moe.shared_gate_proj"], sg
            yield n["moe.shared_up"], su
            yield n["moe.shared_down"], m["shared_down"]
            if "shared_gate" in m:
                yield n["moe.shared_gate"], m["shared_gate"]
    yield GLOBAL["norm"], weights.norm
    if not cfg.tie_word_embeddings:
        yield GLOBAL["lm_head"], weights.lm_head


def _mla_weights(cfg, n: dict, a: dict):
    """MLA in llama.cpp's names: ``kv_b [H*(dn+dv), r]`` split per head into ``k_b [H, r, dn]`` (transposed) and
    ``v_b [H, dv, r]``, as the converter does for its absorbed attention."""
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


def export_gguf(model_dir, out, policy=None, allow_outside: bool = False, force: bool = False, inputs=()) -> dict:
    """Write ``model_dir`` (an MoE checkpoint of ``names.ARCHS``) quantized by ``policy`` to the GGUF file ``out``; returns
    {"tensors": n, "bytes": file size, "types": {GGML type name: count}}. ``out`` follows the write rule
    (:mod:`toolkit.writes`): never inside the model folder or over an input, replaced only when this toolkit wrote
    it (``force``: any plain file), written atomically."""
    from ..model import Checkpoint, load_config, load_weights
    from ..model.inspect import check_fits
    from ..quant import Policy, quantizing_transform
    from ..writes import WRITER, check_file_target, publish
    from .tokenizer import metadata_from_tokenizer_json, write_metadata

    gguf = _gguf()
    out = check_file_target(out, "gguf", [(model_dir, "the source model"), *inputs], force, "--gguf")
    cfg = load_config(model_dir, allow_outside)
    arch = arch_for(cfg)
    if policy is not None:
        policy, _ = policy.fit(cfg)
    check_fits(cfg, policy, Path(model_dir) / "config.json")
    ck = Checkpoint(model_dir, allow_outside)
    tok_meta = metadata_from_tokenizer_json(Path(ck.dir) / "tokenizer.json", cfg.bos_token_id,
                                            cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
                                            cfg.bos_token_id is not None)
    f16 = str(cfg.torch_dtype).replace("torch.", "") == "float16"
    types: dict[str, int] = {}
    count = [0]

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch.gguf)
        _metadata(writer, cfg, arch, Path(model_dir).name)
        writer.add_quantized_by(WRITER)  # what the write rule checks before replacing this file
        write_metadata(writer, tok_meta)
        weights = load_weights(ck, cfg, quantizing_transform(policy or Policy(), "numba"))
        for name, w in _weights(cfg, arch, weights):
            a, raw = _tensor(gguf, name, w, f16)
            writer.add_tensor(name, a, raw_dtype=raw)
            t = raw.name if raw is not None else {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}[a.dtype]
            types[t] = types.get(t, 0) + 1
            count[0] += 1
        writer.add_file_type(_file_type(gguf, types))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    publish({out: write})
    return {"tensors": count[0], "bytes": out.stat().st_size, "types": types}


def _file_type(gguf, types: dict) -> int:
    """general.file_type: the type of most weights, as llama.cpp's converter and quantizer label a file."""
    ft = gguf.LlamaFileType
    for name, value in (("Q4_0", ft.MOSTLY_Q4_0), ("Q8_0", ft.MOSTLY_Q8_0), ("MXFP4", getattr(ft, "MOSTLY_MXFP4_MOE", None)),
                        ("BF16", ft.MOSTLY_BF16), ("F16", ft.MOSTLY_F16)):
        if name in types and value is not None:
            return int(value)
    return int(ft.ALL_F32)
