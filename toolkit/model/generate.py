"""Generation (streamed token by token, batches of prompts of different lengths) and perplexity."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import ModelError
from .model import MoEModel
from .sampling import SamplingParams, sample_token


@dataclass
class TokenEvent:
    """One generated token of one sequence of the batch; ``done`` marks its last event."""

    seq: int
    token: int
    done: bool
    reason: str = ""  # "stop", "length" when done


def generate_tokens(model: MoEModel, prompts: list[list[int]], params: SamplingParams,
                    max_context: int | None = None) -> Iterator[TokenEvent]:
    """Prefill all prompts (right-padded), then decode one token per step for each unfinished sequence."""
    params.validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ModelError("every prompt needs at least one token")
    lens = np.array([len(p) for p in prompts], np.int64)
    ctx = max_context or model.cfg.max_position_embeddings
    need = int(lens.max()) + params.max_new_tokens
    if need > ctx:
        raise ModelError(f"prompt of {int(lens.max())} tokens + {params.max_new_tokens} new tokens exceeds the "
                         f"context of {ctx} tokens")
    B = len(prompts)
    tokens = np.zeros((B, int(lens.max())), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    cache = model.new_cache(B, need)
    rng = np.random.default_rng(params.seed)
    seen = [list(p) for p in prompts]
    stops = set(params.stop_token_ids)
    done = np.zeros(B, bool)
    if params.max_new_tokens == 0:
        return
    logits = model.forward(tokens, cache, lengths=lens, last_only=True)  # [B, V]
    for step in range(params.max_new_tokens):
        nxt = np.zeros((B, 1), np.int64)
        for b in range(B):
            if done[b]:
                continue
            tok = sample_token(logits[b], np.asarray(seen[b]), params, rng)
            seen[b].append(tok)
            nxt[b, 0] = tok
            reason = "stop" if tok in stops else ("length" if step == params.max_new_tokens - 1 else "")
            done[b] = bool(reason)
            yield TokenEvent(b, tok, bool(reason), reason)
        if done.all():
            return
        logits = model.forward(nxt, cache, last_only=True)


def perplexity(model: MoEModel, ids: list[int], window: int, stride: int | None = None, progress=None) -> dict:
    """Sliding-window perplexity: each window of ``window`` tokens starts ``stride`` after the previous
    one; only tokens not scored before are scored, each with up to ``window - 1`` tokens of context.
    With ``stride == window`` (disjoint windows) the first token of each later window has no context and
    is not scored, as in transformers' perplexity guide; ``tokens`` in the result counts what was scored."""
    stride = stride or window // 2
    if window < 2 or not 0 < stride <= window:
        raise ModelError(f"need window >= 2 and 0 < stride <= window (got {window}, {stride})")
    if len(ids) < 2:
        raise ModelError("need at least two tokens to measure perplexity")
    ids = np.asarray(ids, np.int64)
    nll, count, prev_end = 0.0, 0, 0
    starts = list(range(0, max(1, len(ids) - 1), stride))
    for begin in starts:
        end = min(begin + window, len(ids))
        if end <= prev_end:
            continue
        chunk = ids[begin:end]
        cache = model.new_cache(1, len(chunk))
        logits = model.forward(chunk[None], cache)[0].astype(np.float64)  # [n, V]
        first = max(prev_end, begin + 1) - begin  # first position (in chunk) whose token is newly scored
        lp = logits[first - 1 : -1]  # predictions of chunk[first:]
        lse = lp.max(-1) + np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1))
        nll += float((lse - lp[np.arange(len(lp)), chunk[first:]]).sum())
        count += len(lp)
        prev_end = end
        if progress is not None:
            progress.update(1)
        if end == len(ids):
            break
    return {"perplexity": math.exp(nll / count), "tokens": count, "nll": nll / count, "window": window, "stride": stride}
