"""cuda nll: launcher of ``cuda_src/nll.cu``. ``logits f32 [N, V], targets int32 [N] -> f32 [N]``,
``logsumexp(logits[n]) - logits[n, targets[n]]`` (NaN for a target outside ``[0, V)``)."""
from __future__ import annotations

import numpy as np

from .contract import check_array, contract

SOURCE = "nll"
KERNELS = ("nll_kernel",)
THREADS = 256


def check_nll(logits, targets, out) -> None:
    check_array("nll", "logits", logits, np.float32, ndim=2)
    contract("nll", logits.shape[1] >= 1, "the vocabulary V must hold at least one token")
    check_array("nll", "targets", targets, np.int32, shape=(logits.shape[0],))
    if out is not None:
        check_array("nll", "out", out, np.float32, shape=(logits.shape[0],))


def run_nll(rt, logits, targets, out=None):
    check_nll(logits, targets, out)
    N, V = logits.shape
    out = rt.xp.empty((N,), np.float32) if out is None else out  # [N]
    if N:
        rt.launch(SOURCE, "nll_kernel", (N,), (THREADS,), (logits, targets, out, np.int32(V)))
    return out
