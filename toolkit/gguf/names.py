"""How llama.cpp names a Mixtral-family model in GGUF (its converter, ``conversion/llama.py``): architecture
``llama``, hyperparameters under ``llama.*``, tensors ``blk.N.*``, experts merged per projection
``[E, out, in]``, and q/k rows permuted for GGML's rope on adjacent pairs (ours and transformers' rotate the
two halves of a head). Shared by the writer (``export.py``) and the reader (``read.py``).

Shapes are ours (numpy order, ``[out, in]``); GGUF lists dims innermost first, which the ``gguf`` package
handles both ways.
"""
from __future__ import annotations

import numpy as np

from ..formats import FORMATS, QTensor

ARCH = "llama"
ARCHITECTURES = ("MixtralForCausalLM",)  # what the writer takes (the reader takes llama-arch files with experts)

# our weight role -> GGUF tensor name (``{i}``: the layer)
GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
LAYER = {"attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
         "attn.q": "blk.{i}.attn_q.weight", "attn.k": "blk.{i}.attn_k.weight", "attn.v": "blk.{i}.attn_v.weight",
         "attn.o": "blk.{i}.attn_output.weight", "moe.router": "blk.{i}.ffn_gate_inp.weight",
         "moe.gate": "blk.{i}.ffn_gate_exps.weight", "moe.up": "blk.{i}.ffn_up_exps.weight",
         "moe.down": "blk.{i}.ffn_down_exps.weight"}

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
