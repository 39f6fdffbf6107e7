"""Sampling against transformers' logits processors, seeds, stop tokens, perplexity, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

from toolkit.errors import ModelError
from toolkit.model.sampling import SamplingParams, apply_repetition_penalty, next_token_probs, sample_token

torch = pytest.importorskip("torch")
from transformers.generation.logits_process import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

# (temperature, top_k, top_p, repetition penalty)
SAMPLING_CASES = [(1.0, 0, 1.0, 1.0), (0.7, 5, 1.0, 1.0), (1.3, 0, 0.9, 1.0), (0.8, 20, 0.5, 1.3), (1.0, 1, 1.0, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p,penalty", SAMPLING_CASES)
def test_distribution_matches_transformers(temperature, top_k, top_p, penalty):
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(50) * 3).astype(np.float32)
    seen = rng.integers(0, 50, 12)
    ours = next_token_probs(logits, seen, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                         repetition_penalty=penalty))
    scores = torch.tensor(logits[None].astype(np.float64))
    ids = torch.tensor(seen[None])
    procs = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    for proc in procs:
        scores = proc(ids, scores)
    ref = torch.softmax(scores, -1)[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-12)


def test_repetition_penalty_sign_rule():
    out = apply_repetition_penalty(np.array([2.0, -2.0, 1.0]), np.array([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_seed_reproducible_and_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=3)
    a = [sample_token(logits, np.array([], int), p, np.random.default_rng(3)) for _ in range(5)]
    b = [sample_token(logits, np.array([], int), p, np.random.default_rng(3)) for _ in range(5)]
    assert a == b
    assert sample_token(logits, np.array([], int), SamplingParams(), np.random.default_rng(0)) == int(np.argmax(logits))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(max_new_tokens=-1), dict(repetition_penalty=0)])
def test_bad_sampling_parameters_are_clear_errors(bad):
    with pytest.raises(ModelError, match=next(iter(bad))):
        SamplingParams(**bad).validate()
