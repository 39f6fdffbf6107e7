"""cuda sample: launcher of ``cuda_src/sample.cu`` (next-token sampling on the device; toolkit/ref/sample.py).

``run_sample``: ``logits f32 [B, V]``, temperature (0: greedy), top_k (0: off), top_p (1: off),
repetition_penalty, seed (u64) and step (the same for every sequence), ``seen uint8 [B, V]`` (read for the
repetition penalty, then ``seen[b, out[b]] = 1``) -> ``out int32 [B]``. ``step`` is an int, or an int32 [B]
device array read by the kernel (row b draws with ``step[b]``: pass the cache lengths and a recorded decode
step, replayed, still draws a fresh number per token). One block per sequence;
``scratch f32 [B, V]`` is its work space (allocated per call when None; pass one to keep the allocations of a
recorded step fixed).
``run_mark_seen``: prefill, ``ids int32 [B, T]``, ``lengths int32 [B]`` -> ``seen[b, ids[b, t]] = 1`` for
``t < lengths[b]``.
"""
from __future__ import annotations

import math

import numpy as np

from .contract import NULL, check_array, contract

SOURCE = "sample"
KERNELS = ("sample_kernel", "mark_seen_kernel")
MAX_THREADS, TOKENS_PER_THREAD, MARK_THREADS = 1024, 8, 256  # SAMPLE_THREADS, MARK_THREADS in the .cu


def block_threads(V: int) -> int:
    """About TOKENS_PER_THREAD tokens per thread: a multiple of 32 in [32, MAX_THREADS]."""
    return min(MAX_THREADS, max(32, -(-V // (32 * TOKENS_PER_THREAD)) * 32))


def check_sample(logits, temperature, top_k, top_p, repetition_penalty, step, seen, out, scratch) -> None:
    op = "sample"
    check_array(op, "logits", logits, np.float32, ndim=2)
    B, V = logits.shape
    contract(op, 1 <= V < 2**31, f"V={V} tokens; need 1 <= V < 2**31")
    check_array(op, "seen", seen, np.uint8, shape=(B, V))
    if out is not None:
        check_array(op, "out", out, np.int32, shape=(B,))
    if scratch is not None:
        check_array(op, "scratch", scratch, np.float32, shape=(B, V))
    if hasattr(step, "shape"):
        check_array(op, "step", step, np.int32, shape=(B,))
    contract(op, math.isfinite(temperature) and temperature >= 0, f"temperature={temperature} must be finite and >= 0")
    contract(op, 0 <= int(top_k) < 2**31, f"top_k={top_k} must be >= 0 (0: off)")
    contract(op, 0 < np.float32(top_p) <= 1, f"top_p={top_p} must lie in (0, 1] (as f32)")
    contract(op, math.isfinite(repetition_penalty) and repetition_penalty > 0,
             f"repetition_penalty={repetition_penalty} must be finite and > 0")


def run_sample(rt, logits, temperature: float, top_k: int, top_p: float, repetition_penalty: float, seed, step,
               seen, out=None, scratch=None):
    check_sample(logits, temperature, top_k, top_p, repetition_penalty, step, seen, out, scratch)
    B, V = logits.shape
    out = rt.xp.empty((B,), np.int32) if out is None else out  # [B]
    if B:
        if scratch is None and temperature > 0:  # greedy never touches it
            scratch = rt.xp.empty((B, V), np.float32)  # [B, V] e between the passes
        per_row = hasattr(step, "shape")
        rt.launch(SOURCE, "sample_kernel", (B,), (block_threads(V),),
                  (logits, seen, NULL if scratch is None else scratch, out, np.int32(V), np.float32(temperature),
                   np.int32(top_k), np.float32(top_p), np.float32(repetition_penalty), np.uint64(seed),
                   np.int32(0 if per_row else step), step if per_row else NULL))
    return out


def check_mark_seen(ids, lengths, seen) -> None:
    check_array("mark_seen", "ids", ids, np.int32, ndim=2)
    check_array("mark_seen", "lengths", lengths, np.int32, shape=(ids.shape[0],))
    check_array("mark_seen", "seen", seen, np.uint8, ndim=2)
    contract("mark_seen", seen.shape[0] == ids.shape[0], f"seen has {seen.shape[0]} rows, ids {ids.shape[0]}")


def run_mark_seen(rt, ids, lengths, seen) -> None:
    check_mark_seen(ids, lengths, seen)
    (B, T), V = ids.shape, seen.shape[1]
    if B and T:
        rt.launch(SOURCE, "mark_seen_kernel", (B, -(-T // MARK_THREADS)), (MARK_THREADS,),
                  (ids, lengths, seen, np.int32(T), np.int32(V)))
