"""Sampling: repetition penalty -> temperature -> top-k -> top-p -> draw (greedy when temperature is 0)."""
from __future__ import annotations

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
        if self.max_new_tokens < 0:
            raise ModelError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ModelError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ModelError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ModelError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


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
