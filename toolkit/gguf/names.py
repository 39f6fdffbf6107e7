"""How llama.cpp names an MoE model in GGUF (its converter, ``conversion/{llama,qwen,olmo}.py``, and its
loaders, ``src/models/*.cpp``), as data: one record per architecture, one table of tensor names. Shared by the
writer (``export.py``) and the reader (``read.py``).

- ``llama`` (Mixtral): q/k rows permuted per head for GGML's rope on adjacent pairs (ours and transformers'
  rotate the two halves of a head); top-k weights renormalised.
- ``qwen2moe``: biases on q/k/v, a shared expert with a sigmoid gate; top-k weights not renormalised.
- ``qwen3moe``: q/k RMSNorm per head; top-k weights renormalised (llama.cpp fixes it; Qwen3-MoE ships so).
- ``olmoe``: q/k RMSNorm over the projection; top-k weights not renormalised.
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
    norm_topk: bool  # whether llama.cpp renormalises the top-k weights for this architecture
    expert_ff: bool  # {arch}.expert_feed_forward_length holds the experts' intermediate size
    experts_key: str  # config.json keys of the expert count and size
    expert_size_key: str


ARCHS = {a.gguf: a for a in (
    Arch("llama", "MixtralForCausalLM", True, True, False, "num_local_experts", "intermediate_size"),
    Arch("qwen2moe", "Qwen2MoeForCausalLM", False, False, True, "num_experts", "moe_intermediate_size"),
    Arch("qwen3moe", "Qwen3MoeForCausalLM", False, True, True, "num_experts", "moe_intermediate_size"),
    Arch("olmoe", "OlmoeForCausalLM", False, False, False, "num_experts", "intermediate_size"),
)}
BY_HF = {a.hf: a for a in ARCHS.values()}

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
         "moe.shared_down": "blk.{i}.ffn_down_shexp.weight", "moe.shared_gate": "blk.{i}.ffn_gate_inp_shexp.weight"}

# GGML type id -> our format (f32, f16, bf16, q8_0, q4_0, mxfp4: the types our registry holds)
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
