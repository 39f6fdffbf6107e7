"""GGUF names every family shares: the global tensors, the GGML types of our formats, GGML's rope row order, and our
own metadata key. Each family's layer tensor names and ``{arch}.*`` keys belong to its parts
(``toolkit/families/parts``), shared by the writer (``export.py``) and the reader (``read.py``). Shapes are ours
(numpy order, ``[out, in]``); GGUF lists dims innermost first, which the ``gguf`` package handles both ways.
"""
from __future__ import annotations

import numpy as np

from ..formats import FORMATS, QTensor


GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
YARN_TRUNCATE = "rope.scaling.yarn_truncate"  # ours, beside llama.cpp's keys: False where the model does not round
# yarn's correction range (gpt-oss); llama.cpp ignores it and always rounds, as its converter's files assume

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
