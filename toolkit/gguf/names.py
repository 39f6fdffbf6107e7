"""How llama.cpp names an MoE model in GGUF (its converter, ``conversion/{llama,qwen,olmo}.py``, and its
loaders, ``src/models/*.cpp``), as data: one record per architecture, one table of tensor names. Shared by the
writer (``export.py``) and the reader (``read.py``).

- ``llama`` (Mixtral): q/k rows permuted per head for GGML's rope on adjacent pairs (ours and transformers'
  rotate the two halves of a head); top-k weights renormalised.
- ``qwen2moe``: biases on q/k/v, a shared expert with a sigmoid gate; top-k weights not renormalised.
- ``qwen3moe``: q/k RMSNorm per head; top-k weights renormalised (llama.cpp fixes it; Qwen3-MoE ships so).
- ``olmoe``: q/k RMSNorm over the projection; top-k weights not renormalised.
- ``deepseek2`` (DeepSeek-V2 / V3): MLA with the key/value up-projection split per head into ``attn_k_b``
  ``[H, r, dn]`` (transposed) and ``attn_v_b`` ``[H, dv, r]`` (old files: one ``attn_kv_b``), written as MQA
  (``head_count_kv`` 1); rope on adjacent pairs as the checkpoint stores them; leading dense layers; shared experts
  as one MLP; sigmoid (V3, with ``exp_probs_b``) or softmax (V2) gating, expert groups, a routed scale.
- ``glm4moe`` (GLM-4.5): GQA with q/k/v biases, optional per-head q/k norms, rope on the first
  ``rope.dimension_count`` dims of a head (halves); DeepSeek-V3's MoE parts (leading dense layers, shared experts,
  sigmoid gating with ``exp_probs_b``, groups, routed scale); the FFN norm named ``post_attention_norm``;
  ``block_count`` includes the NextN (MTP) layers.
- ``gpt-oss``: biases on q/k/v/o, the router and every expert projection; one attention sink per head; the FFN norm
  named ``post_attention_norm``; sliding-window attention on even layers (llama.cpp's pattern of 2); yarn rope; the
  clamped SwiGLU with llama.cpp's fixed alpha 1.702 and limit 7.
Experts are merged per projection ``[E, out, in]`` in every one. Shapes are ours (numpy order, ``[out, in]``);
GGUF lists dims innermost first, which the ``gguf`` package handles both ways.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import FORMATS, QTensor


@dataclass(frozen=True)
class Arch:
    gguf: str  # general.architecture
    hf: str  # the config.json architecture it stands for
    rope_pairs: bool  # q/k rows in GGML's adjacent-pair rope order
    norm_topk: bool | None  # whether llama.cpp renormalises the top-k weights (None: the file says)
    expert_ff: bool  # {arch}.expert_feed_forward_length holds the experts' intermediate size
    experts_key: str  # config.json keys of the expert count and size
    expert_size_key: str
    qkv_bias: bool = False  # llama.cpp reads biases on q/k/v (and o, router, experts for gpt-oss)
    names: tuple = ()  # (our role, GGUF name) where this architecture's name differs from LAYER's
    swa_pattern: int = 0  # llama.cpp's sliding-window pattern: layer i slides when i % n < n - 1 (0: none)
    hf_alt: tuple = ()  # other config.json architectures it stands for (deepseek2: V2 and V3)


ARCHS = {a.gguf: a for a in (
    Arch("llama", "MixtralForCausalLM", True, True, False, "num_local_experts", "intermediate_size"),
    Arch("qwen2moe", "Qwen2MoeForCausalLM", False, False, True, "num_experts", "moe_intermediate_size", qkv_bias=True),
    Arch("qwen3moe", "Qwen3MoeForCausalLM", False, True, True, "num_experts", "moe_intermediate_size"),
    Arch("olmoe", "OlmoeForCausalLM", False, False, False, "num_experts", "intermediate_size"),
    Arch("gpt-oss", "GptOssForCausalLM", False, True, True, "num_local_experts", "intermediate_size", qkv_bias=True,
         names=(("ffn_norm", "blk.{i}.post_attention_norm.weight"),), swa_pattern=2),
    # norm_topk None: from {arch}.expert_weights_norm; V3 (sigmoid gating) or V2 (softmax) by expert_gating_func
    Arch("deepseek2", "DeepseekV3ForCausalLM", False, None, True, "n_routed_experts", "moe_intermediate_size",
         hf_alt=("DeepseekV2ForCausalLM",)),
    Arch("glm4moe", "Glm4MoeForCausalLM", False, None, True, "n_routed_experts", "moe_intermediate_size", qkv_bias=True,
         names=(("ffn_norm", "blk.{i}.post_attention_norm.weight"),)),
)}
BY_HF = {h: a for a in ARCHS.values() for h in (a.hf, *a.hf_alt)}
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func

# our weight role -> GGUF tensor name (``{i}``: the layer); roles a family lacks are simply absent
GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
LAYER = {"attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
         "attn.q": "blk.{i}.attn_q.weight", "attn.k": "blk.{i}.attn_k.weight", "attn.v": "blk.{i}.attn_v.weight",
         "attn.o": "blk.{i}.attn_output.weight",
         "attn.q_bias": "blk.{i}.attn_q.bias", "attn.k_bias": "blk.{i}.attn_k.bias", "attn.v_bias": "blk.{i}.attn_v.bias",
         "attn.o_bias": "blk.{i}.attn_output.bias",
         "attn.q_norm": "blk.{i}.attn_q_norm.weight", "attn.k_norm": "blk.{i}.attn_k_norm.weight",
         "moe.router": "blk.{i}.ffn_gate_inp.weight",
         "moe.gate": "blk.{i}.ffn_gate_exps.weight", "moe.up": "blk.{i}.ffn_up_exps.weight",
         "moe.down": "blk.{i}.ffn_down_exps.weight",
         "moe.shared_gate_proj": "blk.{i}.ffn_gate_shexp.weight", "moe.shared_up": "blk.{i}.ffn_up_shexp.weight",
         "moe.shared_down": "blk.{i}.ffn_down_shexp.weight", "moe.shared_gate": "blk.{i}.ffn_gate_inp_shexp.weight",
         "attn.sinks": "blk.{i}.attn_sinks.weight", "moe.router_bias": "blk.{i}.ffn_gate_inp.bias",
         "moe.gate_bias": "blk.{i}.ffn_gate_exps.bias", "moe.up_bias": "blk.{i}.ffn_up_exps.bias",
         "moe.down_bias": "blk.{i}.ffn_down_exps.bias", "moe.select_bias": "blk.{i}.exp_probs_b.bias",
         "attn.q_a": "blk.{i}.attn_q_a.weight", "attn.q_a_norm": "blk.{i}.attn_q_a_norm.weight",
         "attn.q_b": "blk.{i}.attn_q_b.weight", "attn.kv_a": "blk.{i}.attn_kv_a_mqa.weight",
         "attn.kv_a_norm": "blk.{i}.attn_kv_a_norm.weight", "attn.k_b": "blk.{i}.attn_k_b.weight",
         "attn.v_b": "blk.{i}.attn_v_b.weight", "attn.kv_b": "blk.{i}.attn_kv_b.weight",
         "mlp.gate": "blk.{i}.ffn_gate.weight", "mlp.up": "blk.{i}.ffn_up.weight", "mlp.down": "blk.{i}.ffn_down.weight"}
OAI_SWIGLU = (1.702, 7.0)  # llama.cpp's fixed alpha and limit of gpt-oss's clamped SwiGLU (ggml_swiglu_oai)
YARN_TRUNCATE = "rope.scaling.yarn_truncate"  # ours, beside llama.cpp's keys: False where the model does not round
# yarn's correction range (gpt-oss); llama.cpp ignores it and always rounds, as its converter's files assume


def layer_names(arch: Arch, i: int) -> dict:
    """Our role -> this architecture's GGUF tensor name in layer i."""
    return {role: t.format(i=i) for role, t in {**LAYER, **dict(arch.names)}.items()}

# GGML type id -> our format (f32, f16, bf16, q8_0, q4_0, mxfp4, q4_1, q5_0, q5_1, q2_K..q6_K: the registry's)
GGML_FORMATS = {f.ggml_type: f for f in FORMATS.values() if f.ggml_type is not None}


def rope_rows(w, n_head: int, inverse: bool = False):
    """Rows of a q or k projection ``[n_head * hd, ...]`` from halves to adjacent pairs per head (llama.cpp's
    order; ``inverse``: back). A row permutation, so a QTensor of row-wise blocks is permuted as stored."""
    rows = w.shape[-2] if isinstance(w, QTensor) else w.shape[0]
    hd = rows // n_head
    idx = np.arange(rows).reshape(n_head, 2, hd // 2)  # [head, half, i]
    perm = (idx.transpose(0, 2, 1) if not inverse else idx.reshape(n_head, hd // 2, 2).transpose(0, 2, 1)).reshape(-1)
    if isinstance(w, QTensor):
        return QTensor(w.fmt, w.shape, {k: np.ascontiguousarray(np.take(a, perm, axis=-2)) for k, a in w.arrays.items()})
    return np.ascontiguousarray(w[perm])
