"""``moqe export --gguf OUT.gguf``: a checkpoint of a family that names a GGUF architecture (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2/V3, GLM-4.5), quantized by a policy, written as the GGUF file llama.cpp's
converter would write (names and hyperparameters: each family's parts, ``toolkit/families/parts``; tokenizer:
``tokenizer.py``).

Weights in a GGML type are written as stored: q8_0 / q4_0 / mxfp4 blocks are GGML's bytes, so the policy's
blocks go in unchanged. Unquantized 2-D and 3-D weights are written in f16 when the checkpoint is f16 and
f16 holds them exactly, else f32; norms in f32 (as the converter does). A format GGML has no type for
(int8, int4, int3, int2, fp8) is refused, naming the weight. The file is written next to ``OUT`` and renamed
onto it when complete: a failed export leaves nothing behind.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..formats import QTensor
from ..uqff.keys import split_rows
from ..families import FAMILIES
from .names import GLOBAL


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


def family_for(cfg):
    """The config's family, or a ModelError saying what GGUF export takes or what of this config llama.cpp's
    architecture for the family does not run (each part says what of its own)."""
    fam = cfg.family
    if fam.gguf is None:
        takes = ", ".join(f.name for f in FAMILIES.values() if f.gguf)
        raise ModelError(f"GGUF export takes {takes}; this model is {fam.name}")
    problems = [what for part in (fam.rope, fam.layers, fam.attention, fam.router, fam.experts)
                for what in part.gguf_problems(cfg)]
    if problems:
        raise ModelError(f"GGUF export: this {fam.name} has {', '.join(problems)}, which llama.cpp's "
                         f"{fam.gguf} architecture does not run")
    return fam


def _metadata(writer, cfg, name: str) -> None:
    """The generic keys, then each part's own."""
    writer.add_name(name)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.kv_layout[0])  # MLA as MQA (one cached head), as the converter says
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    if cfg.rope_type == "yarn":  # as llama.cpp's converter writes it (the rope part adds what is the family's)
        p = cfg.rope_params
        writer.add_rope_scaling_type(_gguf().RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(p["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(p.get("original_max_position_embeddings") or cfg.max_position_embeddings))
        for k, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if p.get(k) is not None:
                add(float(p[k]))
        if p.get("mscale_all_dim"):  # DeepSeek: llama.cpp's 0.1 * mscale_all_dim (its mscale equal to it)
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(p["mscale_all_dim"]))
    for part in cfg.family.parts:
        part.gguf_metadata(writer, cfg)


def _weights(cfg, weights):
    """(GGUF name, weight) in the converter's order: embeddings, layers, final norm, head."""
    fam = cfg.family
    yield GLOBAL["embed"], weights.embed
    for i, lw in enumerate(weights.layers):
        n = fam.layer_names(i)
        yield n["attn_norm"], lw.attn_norm
        yield from fam.attention.gguf_weights(cfg, n, lw.attn)
        yield n["ffn_norm"], lw.ffn_norm
        if lw.moe is None:  # a dense MLP layer
            gate, up = split_rows(lw.mlp["gate_up"], 2)
            yield n["mlp.gate"], gate
            yield n["mlp.up"], up
            yield n["mlp.down"], lw.mlp["down"]
            continue
        yield from fam.router.gguf_weights(cfg, n, lw.moe)
        yield from fam.experts.gguf_weights(cfg, n, lw.moe)
    yield GLOBAL["norm"], weights.norm
    if not cfg.tie_word_embeddings:
        yield GLOBAL["lm_head"], weights.lm_head


def export_gguf(model_dir, out, policy=None, allow_outside: bool = False, force: bool = False, inputs=()) -> dict:
    """Write ``model_dir`` (an MoE checkpoint of a family with a GGUF architecture) quantized by ``policy`` to the GGUF file ``out``; returns
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
    fam = family_for(cfg)
    if policy is not None:
        policy, _ = policy.fit(cfg)
    check_fits(cfg, policy, Path(model_dir) / "config.json")
    ck = Checkpoint(model_dir, allow_outside)
    # a token per embedding row at least, "[PAD{i}]" past the tokenizer's ids as the converter writes them: llama.cpp
    # refuses a token list shorter than token_embd (Mixtral's 32000 / Qwen3's 151936 rows over smaller tokenizers).
    # A longer one (a small test model over a real tokenizer) is kept whole, as our reader takes it
    tok_meta = metadata_from_tokenizer_json(Path(ck.dir) / "tokenizer.json", cfg.bos_token_id,
                                            cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
                                            cfg.bos_token_id is not None, pad_to=cfg.vocab_size)
    f16 = str(cfg.torch_dtype).replace("torch.", "") == "float16"
    types: dict[str, int] = {}
    count = [0]

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), fam.gguf)
        _metadata(writer, cfg, Path(model_dir).name)
        writer.add_quantized_by(WRITER)  # what the write rule checks before replacing this file
        write_metadata(writer, tok_meta)
        weights = load_weights(ck, cfg, quantizing_transform(policy or Policy(), "numba"))
        for name, w in _weights(cfg, weights):
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
