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

from helpers import assert_close, dot_tol, run_on
from toolkit.errors import BackendError
from toolkit.gpu.add import run_add
from toolkit.gpu.device import EmuDevice
from toolkit.gpu.embedding import run_embedding
from toolkit.gpu.gated_add import run_gated_add
from toolkit.gpu.gather_rows import run_gather_rows
from toolkit.gpu.linear import run_linear
from toolkit.gpu.nll import run_nll
from toolkit.gpu.positions import run_positions
from toolkit.gpu.rope import run_rope
from toolkit.gpu.sample import run_sample
from toolkit.ref.embedding import embedding
from toolkit.ref.linear import linear

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


# ---- linear: the dense GEMM of a recorded (decode) step ---------------------------------------------------
# (M, N, K, offset): one row; a batch past one group of 8 rows; K % 4 != 0 (the float path); bases 4 bytes off
# 16-byte alignment (the float path though K % 4 == 0); N not a multiple of the block's 4 warps
LINEAR_CASES = [(1, 40, 256, 0), (11, 9, 128, 0), (3, 5, 130, 0), (2, 7, 64, 1), (8, 33, 96, 0)]


@pytest.mark.parametrize("M,N,K,offset", LINEAR_CASES)
def test_linear_kernel(rt, M, N, K, offset):
    """f32 sums in another order than NumPy's (helpers.dot_tol), every output written (the emulated device's fresh
    memory is NaN)."""
    a = RNG.standard_normal(M * K + offset).astype(np.float32)[offset:].reshape(M, K)
    w = RNG.standard_normal(N * K + offset).astype(np.float32)[offset:].reshape(N, K)
    out = run_on(rt, run_linear, a, w, rt.empty((M, N), np.float32))
    assert_close(out, linear(a, w), **dot_tol(K))


def test_a_recorded_step_runs_its_dense_gemms_on_the_kernel():
    """Device.gemm (through DeviceOps.linear): eager -> the device GEMM (cuBLAS on a GPU); inside a recorded step
    on a device with ``linear_kernel`` (a GPU, whose steps may become CUDA graphs) -> linear.cu, and the replay gives
    the same bits."""
    from toolkit.gpu.device import Plan
    from toolkit.gpu.ops import DeviceOps

    dev = EmuDevice(linear_kernel=True)
    ops = DeviceOps(dev)
    x, w = RNG.standard_normal((2, 64)).astype(np.float32), RNG.standard_normal((12, 64)).astype(np.float32)
    xd, wd = dev.to_device(x), dev.to_device(w)
    before = dev.counters.snapshot()
    eager = dev.to_host(ops.linear(xd, wd))
    assert dev.counters.since(before).gemms == 1 and "linear_f32" not in dev.launched
    plan = Plan()
    with dev.recording(plan):
        out = ops.linear(xd, wd)
    first = dev.to_host(out)
    assert "linear_f32" in dev.launched and dev.counters.gemms == 1  # no GEMM recorded
    plan.replay(dev)
    assert_close(dev.to_host(out), first, exact=True, what="replay")
    assert_close(first, eager, **dot_tol(64), what="kernel against the eager GEMM")
    plain = EmuDevice()  # the default emulated device keeps np.matmul in recorded steps
    with plain.recording(Plan()):
        DeviceOps(plain).linear(plain.to_device(x), plain.to_device(w))
    assert "linear_f32" not in plain.launched and plain.counters.gemms == 1


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
