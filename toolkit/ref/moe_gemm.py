"""moe_gemm: the grouped GEMM over M-blocks of a moe_align layout, weights in any registry format.

``x [T, K]`` tokens (GEMM1; slot ``s`` reads row ``s // top_k``) or ``[T*A, K]`` slots (GEMM2,
``x_is_slots``); ``w``: QTensor of logical shape ``[E, N, K]``; ``sorted_ids [P]``, ``expert_ids [P/block_m]``
from moe_align -> ``out f32 [T*A, N]``: ``out[s] = x_row(s) @ dequant(w[e]).T`` for every slot ``s`` of a
block of expert ``e`` (sentinels skipped), times ``topk_weights.reshape(-1)[s]`` when given (GEMM2 epilogue).
W8A8 formats (those with an ``act_quant``) first quantize each activation row with it and compute on the
decoded activations: ``a_s[t] * w_s[n] * sum_k dec(a_q[t, k]) dec(w_q[n, k])``.
"""
import numpy as np


def moe_gemm(x, w, sorted_ids, expert_ids, block_m, top_k, topk_weights=None, x_is_slots=False):
    n_slots = x.shape[0] if x_is_slots else x.shape[0] * top_k
    wd = w.dequantize("numpy")  # [E, N, K]
    xa = w.fmt.act_dequant(np.asarray(x, np.float32), "numpy")  # [T or T*A, K]
    out = np.zeros((n_slots, w.shape[-2]), np.float32)  # [T*A, N]
    for b, e in enumerate(expert_ids):
        for s in sorted_ids[b * block_m:(b + 1) * block_m]:
            if s >= n_slots:
                continue  # padding
            row = xa[s] if x_is_slots else xa[s // top_k]  # [K]
            out[s] = row @ wd[e].T
            if topk_weights is not None:
                out[s] *= np.asarray(topk_weights, np.float32).reshape(-1)[s]
    return out
