"""sample: next-token sampling on the device, the specification of ``cuda_src/sample.cu``.

``logits f32 [B, V]``, ``seen uint8 [B, V]`` (1 for every token a sequence has seen: prompt and generated)
and scalars shared by every sequence -> ``out int32 [B]``; then ``seen[b, out[b]] = 1``. ``step`` is an int or
one per sequence (int32 [B]; row b uses ``step[b]``).
For each row b:

1. repetition penalty (as transformers, in f32): a seen token's logit ``l`` becomes ``l / penalty`` when
   ``l > 0``, else ``l * penalty``;
2. ``temperature == 0``: greedy, ``out = argmax(l)``, the lowest index on ties (``np.argmax``); stop here;
3. ``x = l / temperature`` (f32);
4. top-k (``0 < k < V``): keep ``x >= kth``, the k-th largest value of x counted with multiplicity (ties kept);
5. ``e = exp(x - max(x))`` (f32) for kept tokens, 0 for the others: the unnormalised softmax;
6. top-p (``top_p < 1``): sort e descending, take the smallest prefix whose sum reaches ``top_p * sum(e)``,
   ``tau`` its last value; keep ``e >= tau`` (the prefix extended to ties);
7. draw: ``u = uniform(seed, step, b)`` in [0, 1) (below); ``out`` = the first index, in token order, whose
   running sum of the kept e exceeds ``u * sum(kept e)``.

Sums and the draw are in f64 here (the kernel: f32 in a fixed order; a token differs only when ``u`` lands
within rounding of a boundary). Against the CPU sampler (toolkit/model/sampling.py, f64 throughout): the same
greedy token, and the same distribution except that top-p keeps every token tied with its last one.
``uniform`` is counter-based: splitmix64 of the seed, then of that xor the step, then xor the row, and the top
53 bits scaled by 2**-53 (the same integer operations in CUDA).
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, step: int, b: int) -> float:
    """u in [0, 1) for row b of step ``step``: 53 bits of a counter-based hash (step and b as two's complement)."""
    x = splitmix64(int(seed) & MASK64)
    x = splitmix64(x ^ (int(step) & MASK64))
    x = splitmix64(x ^ (int(b) & MASK64))
    return (x >> 11) * 2.0**-53


def penalised(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Step 1: ``[B, V] -> [B, V]`` (f32)."""
    pen = np.float32(penalty)
    l = logits.astype(np.float32)
    return np.where(seen != 0, np.where(l > 0, l / pen, l * pen), l).astype(np.float32)


def weights(logits, temperature, top_k, top_p, penalty, seen) -> np.ndarray:
    """Steps 1, 3-6 (temperature > 0): ``[B, V] -> [B, V]`` f64, the kept e (0 for the dropped tokens)."""
    x = penalised(logits, seen, penalty) / np.float32(temperature)  # [B, V] f32
    B, V = x.shape
    out = np.zeros((B, V), np.float64)
    for b in range(B):
        keep = np.ones(V, bool)
        if 0 < top_k < V:
            kth = np.sort(x[b])[::-1][top_k - 1]  # the k-th largest, with multiplicity
            keep = x[b] >= kth
        e = np.where(keep, np.exp(x[b] - x[b].max()), np.float32(0)).astype(np.float64)  # f32 exp
        if np.float32(top_p) < 1:
            desc = np.sort(e)[::-1]
            mass = np.cumsum(desc)  # [V]
            j = int(np.argmax(mass >= np.float64(np.float32(top_p)) * mass[-1]))  # smallest prefix reaching top_p
            e = np.where(e >= desc[j], e, 0.0)
        out[b] = e
    return out


def sample_probs(logits, temperature, top_k, top_p, penalty, seen) -> np.ndarray:
    """The distribution drawn from (temperature > 0): ``[B, V] -> [B, V]`` f64, rows summing to 1."""
    w = weights(logits, temperature, top_k, top_p, penalty, seen)
    return w / w.sum(axis=1, keepdims=True)


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, penalty: float, seed: int,
           step: int | np.ndarray, seen: np.ndarray) -> np.ndarray:
    """``logits [B, V], seen [B, V] -> out int32 [B]``; marks ``seen[b, out[b]] = 1`` in place."""
    B = logits.shape[0]
    if temperature == 0:
        out = np.argmax(penalised(logits, seen, penalty), axis=1).astype(np.int32)  # [B]
    else:
        w = weights(logits, temperature, top_k, top_p, penalty, seen)  # [B, V]
        out = np.zeros(B, np.int32)
        for b in range(B):
            run = np.cumsum(w[b])  # running sum in token order
            s = step[b] if np.ndim(step) else step
            out[b] = np.argmax(run > uniform(seed, s, b) * run[-1])
    seen[np.arange(B), out] = 1
    return out
