"""The grouped GEMV (toolkit/cpu/grouped_gemv.py) against NumPy, both builds, over a table of groupings: rows
per matrix odd and even, matrices with no rows, output rows not a multiple of 4, read-only (memory-mapped)
weights, rows gathered out of order. Tolerance: ``dot_tol``-style, f32 sums in another order than NumPy's
(1e-5 of the products' scale). And what uses it: ``moe_experts`` on a few rows per expert equals its BLAS path,
and ``Engine``'s prefill grouping (``prefill_groups``) minimises its stated cost."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from helpers import assert_close
from toolkit.cpu._jit import parallel_threshold
from toolkit.cpu.grouped_gemv import grouped_gemv, rows_gemv

RNG = np.random.default_rng(7)
BUILDS = {"serial": 1 << 62, "parallel": 0}

# (rows per matrix, N, K): an empty matrix and odd counts; N % 4 = 3; one matrix of many rows; N below 8 (no
# block to prefetch)
GROUPINGS = [((2, 0, 3, 1), 64, 32), ((1, 1, 1, 1, 1, 1, 1, 1), 35, 48), ((17,), 40, 24), ((0, 4, 0, 5), 6, 16)]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("counts, N, K", GROUPINGS)
@pytest.mark.parametrize("readonly", [False, True])
def test_grouped_gemv_matches_numpy(build, counts, N, K, readonly):
    E, S = len(counts), sum(counts)
    w = RNG.standard_normal((E, N, K)).astype(np.float32)
    if readonly:
        w.flags.writeable = False
    x = RNG.standard_normal((S + 3, K)).astype(np.float32)
    src = RNG.permutation(S + 3)[:S].astype(np.int64)  # rows gathered out of order, some rows of x unused
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    active = np.flatnonzero(np.asarray(counts)).astype(np.int64)
    out = np.full((S, N), np.nan, np.float32)
    with parallel_threshold(BUILDS[build]):
        grouped_gemv(x, src, offsets, active, w, out)
    want = np.concatenate([x[src[offsets[e]:offsets[e + 1]]] @ w[e].T for e in range(E)]).astype(np.float32)
    assert_close(out, want, atol=1e-5 * np.sqrt(K), rtol=1e-5)  # every row written (no NaN left)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("T, N, K", [(2, 9, 16), (16, 64, 256)])
def test_rows_gemv(build, T, N, K):
    x, w = RNG.standard_normal((T, K)).astype(np.float32), RNG.standard_normal((N, K)).astype(np.float32)
    with parallel_threshold(BUILDS[build]):
        got = rows_gemv(x, w)
    assert_close(got, (x @ w.T).astype(np.float32), atol=1e-5 * np.sqrt(K), rtol=1e-5)


def test_moe_experts_few_rows_equals_its_blas_path(monkeypatch):
    """The same layer through the grouped GEMV (a few rows per expert) and through BLAS (the threshold lowered)."""
    from toolkit.cpu import moe_experts as M

    T, E, A, D, I = 12, 8, 2, 64, 96
    x = RNG.standard_normal((T, D)).astype(np.float32)
    ids = np.stack([RNG.permutation(E)[:A] for _ in range(T)]).astype(np.int32)
    w = RNG.random((T, A)).astype(np.float32)
    gu = (RNG.standard_normal((E, 2 * I, D)) * 0.1).astype(np.float32)
    dn = (RNG.standard_normal((E, D, I)) * 0.1).astype(np.float32)
    few = M.moe_experts(x, ids, w, gu, dn)
    monkeypatch.setattr(M, "ROWS_MAX", 0)
    assert_close(few, M.moe_experts(x, ids, w, gu, dn), atol=1e-5, rtol=1e-5)


def _cost(groups, lengths, call):
    return sum(call + (hi - lo) * int(lengths[lo]) for lo, hi in groups)


@pytest.mark.parametrize("lengths, call, want", [
    ([100] * 16, 32, [(0, 16)]),  # equal lengths: one call
    ([120, 10], 32, [(0, 1), (1, 2)]),  # 142 + 64 < 32 + 240
    ([40, 30], 32, [(0, 2)]),  # 32 + 80 < 64 + 70
    ([5], 32, [(0, 1)]),
    ([], 32, []),
])
def test_prefill_groups_table(lengths, call, want):
    from toolkit.serve.engine import prefill_groups

    assert prefill_groups(np.array(lengths, np.int64), call) == want


@pytest.mark.parametrize("seed", range(5))
def test_prefill_groups_is_the_cheapest_cut(seed):
    """Against every contiguous cut of 9 sorted lengths (2^8 of them)."""
    from toolkit.serve.engine import prefill_groups

    lengths = np.sort(np.random.default_rng(seed).integers(1, 200, 9))[::-1]
    got = prefill_groups(lengths, 32)
    assert got[0][0] == 0 and got[-1][1] == 9 and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    best = min(_cost(list(zip((0,) + c, c + (9,))), lengths, 32)
               for r in range(9) for c in itertools.combinations(range(1, 9), r))
    assert _cost(got, lengths, 32) == best
