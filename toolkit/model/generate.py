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


class HostSampler:
    """Sampling on the host (NumPy / Numba backends): ``toolkit.model.sampling`` per sequence."""

    def __init__(self, model, params: SamplingParams, prompts: list[list[int]]):
        self.params, self.rng = params, np.random.default_rng(params.seed)
        self.seen = [list(p) for p in prompts]

    def next(self, logits, step: int, done: np.ndarray) -> np.ndarray:  # logits [B, V] -> ids [B]
        out = np.zeros(len(self.seen), np.int64)
        for b in range(len(self.seen)):
            if not done[b]:  # finished sequences draw nothing (the generator's stream stays as it was)
                out[b] = sample_token(logits[b], np.asarray(self.seen[b]), self.params, self.rng)
                self.seen[b].append(int(out[b]))
        return out


class DeviceSampler:
    """Sampling on the device (``cuda`` / ``cuda-emu``): the ``sample`` kernel reads the logits where the model
    left them, keeps the seen-token mask for the repetition penalty on the device, and only the sampled ids
    ``[B]`` are copied out. Its random draws are a counter-based hash of (seed, step, sequence), so a run
    repeats exactly; greedy decoding equals the host's (argmax, lowest id on ties)."""

    def __init__(self, model, params: SamplingParams, tokens: np.ndarray, lens: np.ndarray):
        rt = model.rt
        self.rt, self.params = rt, params
        self.seen = rt.zeros((tokens.shape[0], model.cfg.vocab_size), np.uint8)  # [B, V]
        rt.op("mark_seen")(rt.ids(tokens), rt.ids(lens), self.seen)
        self.seed = int(params.seed or 0) & (2**64 - 1)
        self.scratch = rt.device.empty((tokens.shape[0], model.cfg.vocab_size), np.float32) if params.temperature > 0 else None

    def next(self, logits, step: int, done: np.ndarray) -> np.ndarray:
        p = self.params
        ids = self.rt.op("sample")(logits, float(p.temperature), int(p.top_k), float(p.top_p),
                                   float(p.repetition_penalty), self.seed, int(step), self.seen, self.scratch)
        return self.rt.host(ids).astype(np.int64)  # [B]: the one copy out per step


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
    stops = set(params.stop_token_ids)
    done = np.zeros(B, bool)
    if params.max_new_tokens == 0:
        return
    sampler = DeviceSampler(model, params, tokens, lens) if model.rt.on_device else HostSampler(model, params, prompts)
    logits = model.forward(tokens, cache, lengths=lens, last_only=True)  # [B, V]
    for step in range(params.max_new_tokens):
        sampled = sampler.next(logits, step, done)  # [B]
        nxt = np.zeros(B, np.int64)
        for b in range(B):
            if done[b]:
                continue
            tok = int(sampled[b])
            nxt[b] = tok
            reason = "stop" if tok in stops else ("length" if step == params.max_new_tokens - 1 else "")
            done[b] = bool(reason)
            yield TokenEvent(b, tok, bool(reason), reason)
        if done.all():
            return
        logits = model.decode(nxt, cache)


def prepare(model: MoEModel) -> None:
    """Load (or compile) the kernels a generation runs before it is timed: a throwaway two-token prompt and
    one decode step on a cache of this model's KV types. Numba loads machine code from its disk cache at a
    kernel's first call (about 0.15 s for the bundled model's decode path): without this, the first
    generation of every process pays it inside its decode time. Runs ``generate_tokens`` (a two-token prompt,
    two new tokens), so the sampler's kernels are loaded too. Costs four tokens of compute."""
    for _ in generate_tokens(model, [[0, 0]], SamplingParams(max_new_tokens=2)):  # the sampler's kernels too
        pass
    model.decode_paths = {"compiled": 0, "staged": 0}


def perplexity(model: MoEModel, ids: list[int], window: int, stride: int | None = None, progress=None,
               reference: MoEModel | None = None) -> dict:
    """Sliding-window perplexity: each window of ``window`` tokens starts ``stride`` after the previous
    one; only tokens not scored before are scored, each with up to ``window - 1`` tokens of context.
    With ``stride == window`` (disjoint windows) the first token of each later window has no context and
    is not scored, as in transformers' perplexity guide; ``tokens`` in the result counts what was scored.

    ``reference`` (e.g. the same checkpoint in full precision): also, on the same windows and scored positions,
    the KL divergence of this model's next-token distribution from the reference's, KL(P_ref || P_model) =
    sum_v p_ref (log p_ref - log p_model) in float64 (``kld_mean``, its 99th percentile ``kld_p99``, ``kld_max``),
    ``top1_agreement`` (the share of positions where both models' most likely token is the same) and the
    reference's own ``ref_perplexity``: llama.cpp's --kl-divergence statistics."""
    stride = stride or window // 2
    if window < 2 or not 0 < stride <= window:
        raise ModelError(f"need window >= 2 and 0 < stride <= window (got {window}, {stride})")
    if len(ids) < 2:
        raise ModelError("need at least two tokens to measure perplexity")
    ids = np.asarray(ids, np.int64)
    nll, count, prev_end = 0.0, 0, 0
    kls, agree, ref_nll = [], 0, 0.0
    starts = list(range(0, max(1, len(ids) - 1), stride))
    for begin in starts:
        end = min(begin + window, len(ids))
        if end <= prev_end:
            continue
        chunk = ids[begin:end]
        cache = model.new_cache(1, len(chunk))
        logits = model.forward(chunk[None], cache)  # [1, n, V] on the backend
        first = max(prev_end, begin + 1) - begin  # first position (in chunk) whose token is newly scored
        nll += float(_token_nll(model, logits, chunk, first).sum())
        count += len(chunk) - first
        if reference is not None:
            lq = _log_softmax(_host_logits(model, logits)[first - 1 : -1])  # [m, V] this model's predictions
            ref_logits = reference.forward(chunk[None], reference.new_cache(1, len(chunk)))
            lp = _log_softmax(_host_logits(reference, ref_logits)[first - 1 : -1])  # the reference's
            kls.append((np.exp(lp) * (lp - lq)).sum(-1))
            agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            ref_nll -= float(lp[np.arange(len(lp)), chunk[first:]].sum())
        prev_end = end
        if progress is not None:
            progress.update(1)
        if end == len(ids):
            break
    out = {"perplexity": math.exp(nll / count), "tokens": count, "nll": nll / count, "window": window, "stride": stride}
    if reference is not None:
        kl = np.concatenate(kls)  # [tokens]
        out.update(kld_mean=float(kl.mean()), kld_p99=float(np.percentile(kl, 99)), kld_max=float(kl.max()),
                   top1_agreement=agree / count, ref_perplexity=math.exp(ref_nll / count))
    return out


def _host_logits(model, logits) -> np.ndarray:
    """[n, V] float64 on the host (a measurement's copy: the full logits of one window)."""
    a = model.rt.host(logits) if model.rt.on_device else np.asarray(logits)
    return np.asarray(a, np.float64).reshape(-1, model.cfg.vocab_size)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _token_nll(model, logits, chunk: np.ndarray, first: int) -> np.ndarray:
    """-log p(chunk[i] | chunk[:i]) for i >= first, from logits [1, n, V]: on the device with the ``nll``
    kernel (only the per-token values come back), in float64 on the host otherwise."""
    n, V = len(chunk), model.cfg.vocab_size
    rt = model.rt
    if rt.on_device:
        out = rt.op("nll")(logits.reshape(n, V), rt.ids(np.append(chunk[1:], 0)))  # position i predicts i + 1
        return rt.host(out)[first - 1 : n - 1].astype(np.float64)
    lp = np.asarray(logits)[0].astype(np.float64)[first - 1 : -1]  # predictions of chunk[first:]
    lse = lp.max(-1) + np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1))
    return lse - lp[np.arange(len(lp)), chunk[first:]]
