"""The device-resident runtime's small ops (issue 11) where the device has its own contract, run on the CPU
through cuda_src/emu against the NumPy references of toolkit/ref, with a block's threads in forward and in
reverse order; the launchers (toolkit/gpu/<op>.py run_<op>) are exercised as they are on a GPU. The ops every
backend shares (embedding, gather_rows, add, clip, bias_add, gated_add) are tested once, on every backend, in
tests/test_ops.py.

Tolerances: exact for copies, ids, positions, seen marks and sampled tokens (the sampler's rows are random:
a token could differ only if u fell within f32 rounding of a boundary); ROPE_REL scales with
the inputs (sincosf against NumPy's f32 functions); NLL_TOL against the f64 reference.
"""
from __future__ import annotations

import math

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
from toolkit.gpu.sample import run_mark_seen, run_sample
from toolkit.model.sampling import SamplingParams, next_token_probs
from toolkit.ref import sample as sample_ref
from toolkit.ref.embedding import embedding
from toolkit.ref.mark_seen import mark_seen as mark_seen_ref
from toolkit.ref.nll import nll
from toolkit.ref.positions import positions
from toolkit.ref.rope import rope

RNG = np.random.default_rng(11)
ROPE_REL = 1e-6  # |err| <= ROPE_REL * max|x| * scale (measured: 1.4e-7, positions up to 1e5; GPU sincosf: 2 ulp)
NLL_TOL = dict(atol=2e-6, rtol=2e-6)  # f32 sums against f64 (measured: 1.2e-7 relative, one ulp, to V = 262144)

# (B, T, n, hd): one token one head hd 2, odd head count, prefill, decode at Mixtral's 32 x 128, the widest hd
ROPE_SHAPES = [(1, 1, 1, 2), (2, 3, 5, 6), (1, 7, 4, 64), (2, 1, 32, 128), (1, 2, 3, 512)]
# (B, T): decode, odd prefill, T over the block of threads
POSITION_SHAPES = [(1, 1), (3, 7), (2, 300)]
# (N, V): one row of one token, odd V, V not a multiple of the block, Mixtral's vocabulary
NLL_SHAPES = [(1, 1), (3, 33), (4, 1000), (2, 32000)]
# (B, V): one token vocabulary, tiny and odd V, V not a multiple of any block, Mixtral's vocabulary
SAMPLE_SHAPES = [(6, 1), (16, 5), (16, 33), (8, 1000), (1, 32000)]
# (temperature, top_k, top_p, repetition_penalty)
SAMPLE_CASES = [
    (0.0, 0, 1.0, 1.0),  # greedy
    (0.0, 0, 1.0, 1.3),  # greedy, penalised
    (1.0, 0, 1.0, 1.0),  # plain softmax
    (0.7, 50, 0.9, 1.2),  # the usual mix
    (1.0, 1, 1.0, 1.0),  # top-k = 1: the max and its ties
    (1.0, 0, 1e-6, 1.0),  # top-p tiny: the most likely token(s)
    (1.3, 10**6, 0.5, 1.1),  # top-k >= V (off), top-p half
    (0.5, 3, 1.0, 2.0),  # top-k 3, strong penalty
]


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


# ---- rope ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,n,hd", ROPE_SHAPES)
@pytest.mark.parametrize("scale", [1.0, 0.8])
def test_rope(rt, B, T, n, hd, scale):
    x = RNG.standard_normal((B, T, n, hd)).astype(np.float32)
    pos = RNG.integers(0, 100_000, (B, T)).astype(np.int32)  # large angles: f32 products, then sincosf
    pos[0, 0] = 0
    inv_freq = (1.0 / 1e6 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)  # [hd/2]
    want = rope(x, pos, inv_freq, scale)
    got = x.copy()
    run_on(rt, run_rope, got, pos, inv_freq, scale)
    assert_close(got, want, atol=ROPE_REL * float(np.abs(x).max()) * scale, what="rotated")


@pytest.mark.parametrize("hd,rd", [(32, 16), (64, 48), (24, 8)])
def test_rope_partial_rotary(rt, hd, rd):
    """GLM-4.5's partial rotary: inv_freq of rd/2 frequencies rotates the first rd dims; the rest stay as they were."""
    x = RNG.standard_normal((2, 3, 4, hd)).astype(np.float32)
    pos = RNG.integers(0, 5000, (2, 3)).astype(np.int32)
    inv_freq = (1.0 / 1e4 ** (np.arange(0, rd, 2) / rd)).astype(np.float32)  # [rd/2]
    want = rope(x, pos, inv_freq, 1.0)
    assert_close(want[..., rd:], x[..., rd:], exact=True, what="dims past rd")
    got = x.copy()
    run_on(rt, run_rope, got, pos, inv_freq, 1.0)
    assert_close(got, want, atol=ROPE_REL * float(np.abs(x).max()), what="partial")


# ---- positions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T", POSITION_SHAPES)
def test_positions(rt, B, T):
    lens = RNG.integers(0, 1000, B).astype(np.int32)
    lengths = RNG.integers(0, T + 1, B).astype(np.int32)
    want_pos, want_lens = positions(lens, lengths, T)
    got = run_on(rt, run_positions, lens, lengths, T)
    assert_close(got, want_pos, exact=True, what="positions")
    assert_close(lens, want_lens, exact=True, what="lens after the step")


# ---- nll -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,V", NLL_SHAPES)
def test_nll(rt, N, V):
    logits = (RNG.standard_normal((N, V)) * 4 + 10).astype(np.float32)  # offset: the max matters
    targets = RNG.integers(0, V, N).astype(np.int32)
    if N > 2:
        targets[2] = V  # out of range: NaN, no read
    want = nll(logits, targets)
    got = run_on(rt, run_nll, logits, targets)
    assert_close(np.isnan(got), np.isnan(want), exact=True, what="NaN for a target out of range")
    ok = ~np.isnan(want)
    assert_close(got[ok], want[ok], **NLL_TOL, what="nll")


# ---- sampling ------------------------------------------------------------------------------------------
def sample_rows(B: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Random rows with ties: row 0 all equal, row 1 on a coarse grid (many ties), row 2 a tied maximum."""
    logits = (RNG.standard_normal((B, V)) * 3).astype(np.float32)  # [B, V]
    if B > 3:
        logits[0] = 0.5
        logits[1] = np.round(logits[1])
        logits[2, : min(V, 3)] = logits[2].max() + 1
    seen = (RNG.random((B, V)) < 0.2).astype(np.uint8)  # [B, V]
    return logits, seen


@pytest.mark.parametrize("B,V", SAMPLE_SHAPES)
@pytest.mark.parametrize("case", SAMPLE_CASES, ids=lambda c: "t{}-k{}-p{}-r{}".format(*c))
def test_sample(rt, B, V, case):
    logits, seen = sample_rows(B, V)
    want_seen = seen.copy()
    steps = 2 if B * V < 10_000 else 1  # the second step is penalised by the first one's marks
    for step in range(steps):
        want = sample_ref.sample(logits, *case, 123, step, want_seen)
        bufs = dict(out=np.empty(B, np.int32), scratch=np.empty((B, V), np.float32)) if step else {}  # caller's
        got = run_on(rt, run_sample, logits, *case, np.uint64(123), step, seen, **bufs)
        assert_close(got, want, exact=True, what=f"tokens, step {step}")
        assert_close(seen, want_seen, exact=True, what=f"seen after step {step}")


def test_sample_steps_per_row(rt):
    """step as an int32 [B] device array (e.g. the cache lengths): row b draws with step[b], and the same
    launch arguments with new values in step draw new tokens (a recorded decode step replayed)."""
    B, V = 16, 40
    logits = np.tile(RNG.standard_normal(V).astype(np.float32), (B, 1))  # [B, V] one distribution
    seen = np.zeros((B, V), np.uint8)
    steps = RNG.integers(0, 10_000, B).astype(np.int32)
    draws = []
    for _ in range(2):
        want = sample_ref.sample(logits, 1.0, 0, 1.0, 1.0, 7, steps, seen.copy())
        draws.append(run_on(rt, run_sample, logits, 1.0, 0, 1.0, 1.0, 7, steps, seen.copy()))
        assert_close(draws[-1], want, exact=True, what="tokens")
        steps += 1
    assert not np.array_equal(*draws)


def test_sample_greedy_is_argmax(rt):
    """temperature 0 is np.argmax of the penalised logits: the first of tied maxima, the first NaN, all -inf."""
    logits, seen = sample_rows(6, 300)
    logits[3, [7, 100]] = np.nan
    logits[4] = -np.inf
    logits[5, [250, 20]] = 1e9
    seen[5, [250, 20]] = 0
    want = np.argmax(sample_ref.penalised(logits, seen, 1.5), axis=1).astype(np.int32)
    assert_close(run_on(rt, run_sample, logits, 0.0, 0, 1.0, 1.5, 0, 0, seen.copy()), want, exact=True)
    assert want[3] == 7 and want[4] == 0 and want[5] == 20


def test_sample_frequencies_follow_the_distribution():
    """2000 draws of one row (one per sequence: u depends on the row) against sample_probs, with a chi-square
    bound at p = 0.001 (Wilson-Hilferty); filtered tokens are never drawn. Forward order only (the
    statistics do not depend on it; the token-for-token tests run both orders)."""
    V, n = 12, 2000
    row = np.linspace(-1, 2, V).astype(np.float32)
    row[[4, 9]] = row[9]  # a tie
    logits = np.tile(row, (n, 1))  # [n, V]
    seen = np.zeros((n, V), np.uint8)
    seen[:, [2, 11]] = 1  # penalised
    case = (0.8, 8, 1.0, 1.5)
    p = sample_ref.sample_probs(logits[:1], *case, seen[:1])[0]  # [V]
    got = run_on(EmuDevice(), run_sample, logits, *case, 2024, 5, seen.copy())
    assert_close(got, sample_ref.sample(logits, *case, 2024, 5, seen.copy()), exact=True)
    counts = np.bincount(got, minlength=V)
    assert counts[p == 0].sum() == 0, "a token outside top-k was drawn"
    kept = p > 0
    chi2 = float((((counts - n * p) ** 2)[kept] / (n * p[kept])).sum())
    df, z = int(kept.sum()) - 1, 3.09
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, f"chi-square {chi2:.1f} over {df} degrees of freedom exceeds {bound:.1f}"


def test_sample_reference_matches_the_cpu_sampler():
    """sample_probs equals toolkit/model/sampling.py's next_token_probs (f64 throughout) to f32 rounding on
    rows without ties at the top-p boundary (there the spec keeps every tied token)."""
    logits, seen = sample_rows(5, 400)
    logits[:4] = (RNG.standard_normal((4, 400)) * 3).astype(np.float32)  # no ties
    for t, k, top_p, pen in [(0.7, 50, 0.9, 1.2), (1.0, 0, 0.5, 1.0), (1.3, 7, 1.0, 2.0)]:
        params = SamplingParams(temperature=t, top_k=k, top_p=top_p, repetition_penalty=pen)
        want = np.stack([next_token_probs(logits[b], np.flatnonzero(seen[b]), params) for b in range(4)])
        assert_close(sample_ref.sample_probs(logits[:4], t, k, top_p, pen, seen[:4]), want, atol=1e-6)


def test_mark_seen(rt):
    B, T, V = 3, 300, 50
    ids = RNG.integers(0, V, (B, T)).astype(np.int32)
    ids[0, :2] = [-1, V]  # out of range: skipped
    lengths = np.array([T, 3, 0], np.int32)
    seen = np.zeros((B, V), np.uint8)
    want = seen.copy()
    mark_seen_ref(ids, lengths, want)
    run_on(rt, run_mark_seen, ids, lengths, seen)
    assert_close(seen, want, exact=True, what="seen")


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
