"""The device-resident runtime's small ops (issue 11) where the launcher has its own contract, run on the CPU
through cuda_src/emu, with a block's threads in forward and in reverse order; the launchers (toolkit/gpu/<op>.py
run_<op>) are exercised as they are on a GPU: embedding's caller-given output on an unaligned table, and the
layout contracts (named op and condition). The ops themselves (embedding, gather_rows, add, clip, bias_add,
gated_add, rope, positions, sample, mark_seen, nll) are tested once, on every backend, against their NumPy
references in tests/test_ops.py and tests/test_ops_kv.py.

Tolerances: exact for copies.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close, run_on
from toolkit.errors import BackendError
from toolkit.gpu.add import run_add
from toolkit.gpu.device import EmuDevice
from toolkit.gpu.embedding import run_embedding
from toolkit.gpu.gated_add import run_gated_add
from toolkit.gpu.gather_rows import run_gather_rows
from toolkit.gpu.nll import run_nll
from toolkit.gpu.positions import run_positions
from toolkit.gpu.rope import run_rope
from toolkit.gpu.sample import run_sample
from toolkit.ref.embedding import embedding

RNG = np.random.default_rng(11)


@pytest.fixture(params=["forward", "reverse"])
def rt(request):
    return EmuDevice(reverse=request.param == "reverse")


def ids_with_outliers(n: int, V: int) -> np.ndarray:
    ids = RNG.integers(0, V, n).astype(np.int32)  # [n]
    if n > 2:
        ids[1], ids[2] = -1, V  # out of range: a row of zeros, no read
    return ids


# ---- copies --------------------------------------------------------------------------------------------
def test_embedding_unaligned_rows_take_the_float_path(rt):
    """A table whose base is not 16-byte aligned (D % 4 == 0 yet): the kernel copies floats, not Vec4."""
    buf = RNG.standard_normal(9 * 8 + 1).astype(np.float32)
    table = buf[1:].reshape(9, 8)  # base 4 bytes past the allocation: never 16-byte aligned
    ids = np.array([8, 0, 3], np.int32)
    out = np.full((3, 8), np.nan, np.float32)
    assert run_on(rt, run_embedding, ids, table, out=out) is out
    assert_close(out, embedding(ids, table), exact=True, what="rows")


# ---- layout contracts ----------------------------------------------------------------------------------
def test_contracts_name_op_and_condition():
    rt = EmuDevice()
    f32 = np.zeros((2, 8), np.float32)
    with pytest.raises(BackendError, match=r"embedding.*ids.dtype is int64"):
        run_embedding(rt, np.zeros(2, np.int64), f32)
    with pytest.raises(BackendError, match=r"rope.*2 x 4 <= head dim 7"):
        run_rope(rt, np.zeros((1, 1, 1, 7), np.float32), np.zeros((1, 1), np.int32), np.zeros(4, np.float32))
    with pytest.raises(BackendError, match=r"add.*y.shape is \(8,\), expected \(2, 8\)"):
        run_add(rt, f32, np.zeros(8, np.float32))
    with pytest.raises(BackendError, match=r"gated_add.*needs its gate g"):
        run_gated_add(rt, f32, None, f32.copy())
    with pytest.raises(BackendError, match=r"gather_rows.*out.shape"):
        run_gather_rows(rt, f32, np.zeros(3, np.int32), out=np.zeros((2, 8), np.float32))
    with pytest.raises(BackendError, match=r"positions.*lengths.shape"):
        run_positions(rt, np.zeros(2, np.int32), np.zeros(3, np.int32), 4)
    with pytest.raises(BackendError, match=r"sample.*seen.dtype is bool"):
        run_sample(rt, f32, 1.0, 0, 1.0, 1.0, 0, 0, np.zeros((2, 8), bool))
    with pytest.raises(BackendError, match=r"sample.*top_p=0.0 must lie in \(0, 1\]"):
        run_sample(rt, f32, 1.0, 0, 0.0, 1.0, 0, 0, np.zeros((2, 8), np.uint8))
    with pytest.raises(BackendError, match=r"sample.*step.dtype is int64"):
        run_sample(rt, f32, 1.0, 0, 1.0, 1.0, 0, np.zeros(2, np.int64), np.zeros((2, 8), np.uint8))
    with pytest.raises(BackendError, match=r"sample.*scratch.shape is \(8, 2\), expected \(2, 8\)"):
        run_sample(rt, f32, 1.0, 0, 1.0, 1.0, 0, 0, np.zeros((2, 8), np.uint8), scratch=f32.T.copy())
    with pytest.raises(BackendError, match=r"nll.*targets.shape"):
        run_nll(rt, f32, np.zeros(3, np.int32))
