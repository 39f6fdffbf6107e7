"""Attention, the KV cache (kv_store, kv_attention), absorbed MLA and the decode step's bookkeeping (positions,
sample, nll, mark_seen) on every backend against their NumPy references, over shape tables (tolerances declared
per op); the harness: tests/ops_harness.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import assert_close
from ops_harness import F32_TOL, RNG, backend, both, normal  # noqa: F401 - backend, both: fixtures
from test_cuda_emulated import kv_case, kv_rows  # the KV cache cases, shared with its device-only split tests
from toolkit.formats import get_format

# (B, T, H, Hkv, hd, S, start): 1 token decode, prefill, GQA 4:1, MHA, odd head count, mid-cache start
ATTN_SHAPES = [(1, 1, 4, 1, 32, 16, 7), (2, 9, 8, 2, 16, 32, 0), (1, 6, 3, 3, 8, 12, 5), (3, 1, 6, 2, 64, 40, 39)]
WINDOWS = [0, 4]


def attention_case(shape):
    """q [B, T, H, hd], k and v [B, Hkv, S, hd], positions [B, T] (each row one further, capped at S - 1)."""
    B, T, H, Hkv, hd, S, start = shape
    return (normal(B, T, H, hd), normal(B, Hkv, S, hd), normal(B, Hkv, S, hd),
            np.minimum(start + np.arange(T)[None, :] + np.arange(B)[:, None], S - 1))


@pytest.mark.parametrize("shape", ATTN_SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_attention(both, shape, window):
    ref, fast = both("attention")
    B, T, H, Hkv, hd, S, start = shape
    q, k, v, pos = attention_case(shape)
    assert_close(fast(q, k, v, pos, hd**-0.5, window), ref(q, k, v, pos, hd**-0.5, window), **F32_TOL)


@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention_sinks(both, shape):
    """A sink adds exp(sink) to each head's softmax denominator (gpt-oss): checked against the formula too."""
    ref, fast = both("attention")
    B, T, H, Hkv, hd, S, start = shape
    q, k, v, pos = attention_case(shape)
    sinks = (RNG.standard_normal(H) * 2).astype(np.float32)
    want = ref(q, k, v, pos, hd**-0.5, 0, sinks)
    assert_close(fast(q, k, v, pos, hd**-0.5, 0, sinks), want, **F32_TOL)
    p, h = int(pos[-1, -1]), H - 1
    s = np.append(k[-1, h // (H // Hkv), : p + 1] @ q[-1, -1, h] * hd**-0.5, sinks[h])
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert_close(want[-1, -1, h], w[:-1] @ v[-1, h // (H // Hkv), : p + 1], atol=1e-5)


# ---- the decode step's bookkeeping: positions, sampling, nll (the device's own ops; the CPU runs them in NumPy) ----
# (B, T): decode, odd prefill, T over the block of threads
POSITION_SHAPES = [(1, 1), (3, 7), (2, 300)]
# (N, V): one row of one token, odd V, V not a multiple of the block, Mixtral's vocabulary
NLL_SHAPES = [(1, 1), (3, 33), (4, 1000), (2, 32000)]
NLL_TOL = dict(atol=2e-6, rtol=2e-6)  # f32 sums against f64 (measured: 1.2e-7 relative, one ulp, to V = 262144)
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


@pytest.mark.parametrize("B,T", POSITION_SHAPES)
def test_positions(both, B, T):
    """The step's positions [B, T] and the lengths after it: the device updates ``lens`` in place (the
    reference returns the new lengths), so the test reads it back after the op. Exact."""
    ref, fast = both("positions", writes=(0,))
    lens = RNG.integers(0, 1000, B).astype(np.int32)
    lengths = RNG.integers(0, T + 1, B).astype(np.int32)
    want_pos, want_lens = ref(lens.copy(), lengths, T)
    got_pos, got_lens = fast(lens.copy(), lengths, T)
    assert_close(got_pos, want_pos, exact=True, what="positions")
    assert_close(got_lens, want_lens, exact=True, what="lens after the step")


@pytest.mark.parametrize("N,V", NLL_SHAPES)
def test_nll(both, N, V):
    ref, fast = both("nll")
    logits = (RNG.standard_normal((N, V)) * 4 + 10).astype(np.float32)  # offset: the max matters
    targets = RNG.integers(0, V, N).astype(np.int32)
    if N > 2:
        targets[2] = V  # out of range: NaN, no read
    want, got = ref(logits, targets), fast(logits, targets)
    assert_close(np.isnan(got), np.isnan(want), exact=True, what="NaN for a target out of range")
    ok = ~np.isnan(want)
    assert_close(got[ok], want[ok], **NLL_TOL, what="nll")


def sample_rows(B: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Random rows with ties: row 0 all equal, row 1 on a coarse grid (many ties), row 2 a tied maximum."""
    logits = (RNG.standard_normal((B, V)) * 3).astype(np.float32)  # [B, V]
    if B > 3:
        logits[0] = 0.5
        logits[1] = np.round(logits[1])
        logits[2, : min(V, 3)] = logits[2].max() + 1
    seen = (RNG.random((B, V)) < 0.2).astype(np.uint8)  # [B, V]
    return logits, seen


# sample's contract is the reference's algorithm (toolkit/ref/sample.py: a counter-based uniform per (seed, step,
# row), then the inverse CDF of the filtered distribution), so a fixed seed gives the reference's tokens exactly
# (a token could differ only if u fell within f32 rounding of a boundary); the op also marks each drawn token in
# ``seen`` (argument 7) in place, which the test reads back after the op.
@pytest.mark.parametrize("B,V", SAMPLE_SHAPES)
@pytest.mark.parametrize("case", SAMPLE_CASES, ids=lambda c: "t{}-k{}-p{}-r{}".format(*c))
def test_sample(both, B, V, case):
    ref, fast = both("sample", writes=(7,))
    logits, seen = sample_rows(B, V)
    want_seen = seen.copy()
    steps = 2 if B * V < 10_000 else 1  # the second step is penalised by the first one's marks
    for step in range(steps):
        want = ref(logits, *case, 123, step, want_seen)
        scratch = (np.empty((B, V), np.float32),) if step else ()  # the caller's scratch on the second step
        got, seen = fast(logits, *case, np.uint64(123), step, seen, *scratch)
        assert_close(got, want, exact=True, what=f"tokens, step {step}")
        assert_close(seen, want_seen, exact=True, what=f"seen after step {step}")


def test_sample_steps_per_row(both):
    """step as an int32 [B] array (e.g. the cache lengths): row b draws with step[b], and the same call with new
    values in step draws new tokens (a recorded decode step replayed)."""
    ref, fast = both("sample")
    B, V = 16, 40
    logits = np.tile(RNG.standard_normal(V).astype(np.float32), (B, 1))  # [B, V] one distribution
    seen = np.zeros((B, V), np.uint8)
    steps = RNG.integers(0, 10_000, B).astype(np.int32)
    draws = []
    for _ in range(2):
        want = ref(logits, 1.0, 0, 1.0, 1.0, 7, steps, seen.copy())
        draws.append(fast(logits, 1.0, 0, 1.0, 1.0, 7, steps, seen.copy()))
        assert_close(draws[-1], want, exact=True, what="tokens")
        steps += 1
    assert not np.array_equal(*draws)


def test_sample_greedy_is_argmax(both):
    """temperature 0 is np.argmax of the penalised logits: the first of tied maxima, the first NaN, all -inf."""
    from toolkit.ref.sample import penalised

    _, fast = both("sample")
    logits, seen = sample_rows(6, 300)
    logits[3, [7, 100]] = np.nan
    logits[4] = -np.inf
    logits[5, [250, 20]] = 1e9
    seen[5, [250, 20]] = 0
    want = np.argmax(penalised(logits, seen, 1.5), axis=1).astype(np.int32)
    assert_close(fast(logits, 0.0, 0, 1.0, 1.5, 0, 0, seen.copy()), want, exact=True)
    assert want[3] == 7 and want[4] == 0 and want[5] == 20


def test_sample_frequencies_follow_the_distribution(both):
    """2000 draws of one row (one per sequence: u depends on the row) against sample_probs, with a chi-square
    bound at p = 0.001 (Wilson-Hilferty); filtered tokens are never drawn."""
    from toolkit.ref.sample import sample_probs

    ref, fast = both("sample")
    V, n = 12, 2000
    row = np.linspace(-1, 2, V).astype(np.float32)
    row[[4, 9]] = row[9]  # a tie
    logits = np.tile(row, (n, 1))  # [n, V]
    seen = np.zeros((n, V), np.uint8)
    seen[:, [2, 11]] = 1  # penalised
    case = (0.8, 8, 1.0, 1.5)
    p = sample_probs(logits[:1], *case, seen[:1])[0]  # [V]
    got = fast(logits, *case, 2024, 5, seen.copy())
    assert_close(got, ref(logits, *case, 2024, 5, seen.copy()), exact=True)
    counts = np.bincount(got, minlength=V)
    assert counts[p == 0].sum() == 0, "a token outside top-k was drawn"
    kept = p > 0
    chi2 = float((((counts - n * p) ** 2)[kept] / (n * p[kept])).sum())
    df, z = int(kept.sum()) - 1, 3.09
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, f"chi-square {chi2:.1f} over {df} degrees of freedom exceeds {bound:.1f}"


def test_sample_reference_matches_the_cpu_sampler():
    """The spec itself: sample_probs equals toolkit/model/sampling.py's next_token_probs (f64 throughout) to f32
    rounding on rows without ties at the top-p boundary (there the spec keeps every tied token)."""
    from toolkit.model.sampling import SamplingParams, next_token_probs
    from toolkit.ref.sample import sample_probs

    logits, seen = sample_rows(5, 400)
    logits[:4] = (RNG.standard_normal((4, 400)) * 3).astype(np.float32)  # no ties
    for t, k, top_p, pen in [(0.7, 50, 0.9, 1.2), (1.0, 0, 0.5, 1.0), (1.3, 7, 1.0, 2.0)]:
        params = SamplingParams(temperature=t, top_k=k, top_p=top_p, repetition_penalty=pen)
        want = np.stack([next_token_probs(logits[b], np.flatnonzero(seen[b]), params) for b in range(4)])
        assert_close(sample_probs(logits[:4], t, k, top_p, pen, seen[:4]), want, atol=1e-6)


def test_mark_seen(both):
    """The prompt's tokens marked in ``seen`` [B, V] in place (read back after the op); ids out of range skipped."""
    ref, fast = both("mark_seen", writes=(2,))
    B, T, V = 3, 300, 50
    ids = RNG.integers(0, V, (B, T)).astype(np.int32)
    ids[0, :2] = [-1, V]  # out of range: skipped
    lengths = np.array([T, 3, 0], np.int32)
    want = np.zeros((B, V), np.uint8)
    ref(ids, lengths, want)
    _, got = fast(ids, lengths, np.zeros((B, V), np.uint8))
    assert_close(got, want, exact=True, what="seen")


# ---- the KV cache: kv_store writes block bytes in place, kv_attention reads them ------------------------
KV_FORMATS = ["f32", "q8_0", "q4_0"]
KV_PAIRS = [("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("f32", "q4_0")]
# (B, T, Hkv, hd, S): decode, prefill, odd head count, hd 32 / 64 / 128
KV_STORE_SHAPES = [(1, 1, 8, 128, 40), (2, 7, 2, 64, 16), (1, 5, 3, 32, 8)]
# (B, T, H, Hkv, hd, S, start): decode T=1 deep in the cache (the device's key split), prefill from 0, GQA 4:1,
# MHA, rep 12, hd 128 (Mixtral); then splits planned from the capacity (max_keys = S) that find few keys: decode
# at position 3 and at 0 of a cache of 300 (5 splits: one key each, or a single key and 4 empty splits), a T=4
# prefill from 0 (the early queries see 1..4 keys of their 5 splits); then small caches filled to start + T + 2
KV_ATT_SHAPES = [(1, 1, 8, 2, 128, 300, 290), (2, 6, 4, 1, 64, 16, 0), (1, 3, 4, 4, 32, 40, 20),
                 (2, 1, 12, 1, 32, 200, 150), (1, 1, 8, 2, 128, 300, 3), (1, 1, 4, 1, 64, 300, 0),
                 (1, 4, 4, 1, 64, 300, 0), (1, 1, 4, 1, 32, 43, 40), (2, 7, 4, 2, 64, 9, 0), (1, 3, 8, 2, 128, 22, 17),
                 (3, 1, 6, 6, 32, 8, 5)]
KV_ATT_TOL = dict(atol=2e-5, rtol=1e-4)  # f32 softmax, another summation order and expf


# kv_store's contract is the bytes it writes into the caller's cache [B, Hkv, S, row] (argument 0, in place, read
# back after the op): compared byte for byte with the reference's, and with gguf's quantizer
@pytest.mark.parametrize("shape", KV_STORE_SHAPES)
@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_kv_store(both, shape, fmt):
    ref, fast = both("kv_store", writes=(0,))
    B, T, Hkv, hd, S = shape
    f = get_format(fmt)
    x = kv_rows(f, B, T, Hkv, hd, scale=3.0)
    positions = np.stack([RNG.permutation(S)[:T] for _ in range(B)]).astype(np.int32)  # [B, T] scattered
    (spec,) = f.arrays((1, hd)).values()
    want = np.zeros((B, Hkv, S, spec.shape[-1]), spec.dtype)  # [B, Hkv, S, row]
    _, got = fast(want.copy(), f, x, positions)
    ref(want, f, x, positions)
    assert_close(got, want, exact=True, what=f"{fmt} cache bytes")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_kv_store_matches_gguf(both, fmt):
    gguf = pytest.importorskip("gguf")
    _, fast = both("kv_store", writes=(0,))
    f = get_format(fmt)
    x = kv_rows(f, 1, 3, 2, 64, scale=5.0)
    store = np.zeros((1, 2, 5, f.arrays((1, 64))["blocks"].shape[-1]), np.uint8)
    _, store = fast(store, f, x, np.arange(3, dtype=np.int32)[None])
    qt = getattr(gguf.GGMLQuantizationType, fmt.upper())
    want = gguf.quants.quantize(x.transpose(0, 2, 1, 3).reshape(-1, 64), qt).reshape(1, 2, 3, -1)
    assert_close(store[:, :, :3], want, exact=True, what="vs gguf")
    assert not store[:, :, 3:].any()  # untouched rows stay empty


@pytest.mark.parametrize("shape", KV_ATT_SHAPES)
@pytest.mark.parametrize("kf,vf", KV_PAIRS)
@pytest.mark.parametrize("window", [0, 5])
def test_kv_attention(both, shape, kf, vf, window):
    ref, fast = both("kv_attention")
    q, ks, vs, k_fmt, v_fmt, positions, scale = kv_case(kf, vf, *shape)
    want = ref(q, ks, vs, k_fmt, v_fmt, positions, scale, window)
    assert_close(fast(q, ks, vs, k_fmt, v_fmt, positions, scale, window), want, **KV_ATT_TOL,
                 what=f"K {kf} / V {vf}, window {window}")


# ---- absorbed MLA (DeepSeek): the stages around kv_attention over the latent cache ---------------------
# (B, T, H, dn, dr, r, dv); DeepSeek-V3's head: dn 128, dr 64, r 512, dv 128
MLA_SHAPES = [(2, 3, 4, 16, 8, 24, 12), (1, 1, 3, 128, 64, 512, 128), (1, 5, 2, 32, 32, 64, 16)]
MLA_TOL = dict(atol=2e-5, rtol=2e-5)  # K-long f32 dot products (r <= 512) summed in another order


def mla_args(name, B, T, H, dn, dr, r, dv, interleave):
    pos = RNG.integers(0, 3000, (B, T)).astype(np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, dr, 2) / dr)).astype(np.float32)
    if name == "mla_q":
        return normal(B * T, H * (dn + dr)), normal(H, dn, r, scale=0.1), pos, inv, 1.2, interleave
    if name == "mla_kv":
        return normal(B * T, r + dr), normal(r), 1e-6, pos, inv, 1.2, interleave
    return normal(B, T, H, r + dr), normal(H, r, dv, scale=0.1)  # mla_out


@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("name", ["mla_q", "mla_kv", "mla_out"])
def test_mla(both, name, shape, interleave):
    if name == "mla_out" and not interleave:
        pytest.skip("mla_out has no rope (interleave does not apply)")
    ref, fast = both(name)
    args = mla_args(name, *shape, interleave)
    assert_close(fast(*args), ref(*args), **MLA_TOL, what=name)

