"""Sampling: repetition penalty -> temperature -> top-k -> top-p -> draw (greedy when temperature is 0)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ModelError


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple = ()

    def validate(self) -> None:
        """Refuse values that would sample wrongly or crash later: NaN and infinity included."""
        def number(name, v, ok, want):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ModelError(f"{name} must be {want}, got {v!r}")

        def whole(name, v, lo, hi):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise ModelError(f"{name} must be a whole number in [{lo}, {hi}], got {v!r}")

        whole("max_new_tokens", self.max_new_tokens, 0, 1 << 24)
        whole("top_k", self.top_k, 0, 1 << 24)
        number("temperature", self.temperature, lambda v: 0 <= v <= 100, "a finite number in [0, 100] (0 = greedy)")
        number("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        number("repetition_penalty", self.repetition_penalty, lambda v: 0 < v <= 100, "a finite number in (0, 100]")
        if self.seed is not None:
            whole("seed", self.seed, 0, 2**63 - 1)


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """As transformers: a seen token's logit is divided by the penalty when positive, multiplied when negative."""
    if penalty == 1.0 or seen.size == 0:
        return logits
    out = logits.copy()
    ids = np.unique(seen)
    v = out[ids]
    out[ids] = np.where(v > 0, v / penalty, v * penalty)
    return out


def next_token_probs(logits: np.ndarray, seen: np.ndarray, p: SamplingParams) -> np.ndarray:
    """logits [V] -> the distribution sampled from (temperature > 0): penalty, temperature, top-k, top-p."""
    x = apply_repetition_penalty(logits.astype(np.float64), seen, p.repetition_penalty) / p.temperature
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(probs, kind="stable")  # ascending, as transformers: drop the low tail of mass 1 - top_p
        tail = np.cumsum(probs[order]) <= 1 - p.top_p
        tail[-1] = False  # always keep the most likely token
        probs[order[tail]] = 0
        probs /= probs.sum()
    return probs


def sample_token(logits: np.ndarray, seen: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """logits [V] -> one token id (greedy when temperature is 0)."""
    if p.temperature == 0:
        return int(np.argmax(apply_repetition_penalty(logits, seen, p.repetition_penalty)))
    probs = next_token_probs(logits, seen, p)
    return int(rng.choice(probs.size, p=probs))
