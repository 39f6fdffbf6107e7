"""The serving engine: one thread owns the model, and requests join and leave its running batch at every step.

The KV cache holds ``slots`` sequences of ``context`` tokens (``KVCache [slots, Hkv, context, row]``). Running
sequences sit in slots ``0 .. d-1``, so one decode step runs them all through one cache view. A finished
sequence's slot is refilled from the last running slot (its KV rows copied, ``KVCache.move``), which keeps the
running slots contiguous.

The policy, one iteration of the loop:

1. aborted sequences (client gone) leave: a running one frees its slot at once;
2. with no prefill under way, a prefill batch is formed from the head of the queue, first come first served:
   requests while their sequences fit the free slots and their prompt tokens fit ``prefill_tokens`` (one
   request always, however long). Its sequences take the slots after the running ones, longest prompt first;
3. one prefill chunk: at most ``prefill_chunk`` tokens of each of the batch's sequences that still have prompt
   left, as one model call or several (``prefill_groups``: rows of similar length together, so that short prompts
   are not padded to the longest one when the padding would cost more than a call). A sequence whose prompt ends
   samples its first token at once (time to first token). When the last prompt of the batch is done, the batch
   joins the running sequences;
4. one decode step of every running sequence.

So a newcomer waits for at most one iteration before its prefill starts (when slots are free), and the running
sequences' next token waits for at most one prefill chunk.

Sampling is per sequence, on the host, with its own generator (``seed``, else fresh entropy) and parameters:
``toolkit.model.sampling`` (repetition penalty, temperature, top-k, top-p), after OpenAI's presence and frequency
penalties and ``logit_bias``. Greedy is the argmax, as ``moqe generate``'s samplers. Logprobs are those of the
model's own distribution (log-softmax of the logits, before any penalty or temperature).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelError
from ..model.sampling import SamplingParams, sample_token
from .detok import Detokenizer, StopMatcher

_NONE_SEEN = np.zeros(0, np.int64)
CALL_TOKENS = 32  # a prefill call's fixed cost in padded tokens: the bundled model, 1 sequence of 8 .. 128 tokens,
# fits 3.7 ms + 0.14 ms a token (a call of 27 tokens' work); larger models have relatively cheaper calls


class QueueFull(ModelError):
    """The engine's queue is full: the request was not taken (HTTP 503)."""


class EngineClosed(ModelError):
    """The engine has stopped."""


@dataclass
class GenParams:
    """One request's sampling and stopping (the API validates every value before a request is submitted)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit
    stop: tuple = ()  # strings: the text ends before the first one found
    stop_token_ids: tuple = ()  # besides the model's end-of-sequence tokens
    ignore_eos: bool = False
    logprobs: int | None = None  # each generated token's logprob and the top-N alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions' echo)
    routing: bool = False  # count this request's routed experts per MoE layer

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, repetition_penalty=self.repetition_penalty, seed=self.seed)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list  # [(token id, logprob)], likeliest first


@dataclass
class Event:
    """What one choice of a request produced since its last event. ``finish``: None while it runs, else "stop",
    "length", "abort" or "error" (``error`` then says what)."""

    choice: int
    text: str = ""
    tokens: list = field(default_factory=list)  # generated token ids of this event (end-of-sequence left out)
    logprobs: list = field(default_factory=list)  # [TokenLogprob] of ``tokens``
    finish: str | None = None
    error: str = ""
    prompt_logprobs: list | None = None  # [TokenLogprob or None (the first token)], on the first event when asked
    routing: np.ndarray | None = None  # [L, E] tokens this choice routed to each expert, on its last event
    completion_tokens: int = 0  # tokens generated so far (end-of-sequence included), on the last event


class Request:
    """A submitted request: ``n`` sequences of one prompt. Its events reach ``on_event`` from the engine thread."""

    def __init__(self, engine, prompt: list, params: GenParams, n: int, on_event):
        self.engine, self.prompt, self.params, self.on_event = engine, list(prompt), params, on_event
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.seqs = [_Seq(self, i) for i in range(n)]

    def abort(self) -> None:
        """Stop every sequence of this request (a client that went away); safe from any thread, and after it ended."""
        self.engine._abort(self)


class _Seq:
    """One sequence: its slot, prompt progress, sampler and text."""

    def __init__(self, req: Request, choice: int):
        p = req.params
        self.req, self.choice = req, choice
        self.slot = -1
        self.done_prompt = 0  # prompt tokens already in the cache
        self.out: list[int] = []  # generated ids
        self.finished = False
        seed = p.seed if p.seed is None or choice == 0 else [p.seed, choice]  # choice 0: moqe generate --seed's stream
        self.rng = np.random.default_rng(seed)
        self.sampling = p.sampling()
        self.counts: dict[int, int] = {}  # generated token -> times (presence / frequency penalties)
        self.seen = list(req.prompt)  # prompt + generated (the repetition penalty's, as moqe generate)
        self.detok = Detokenizer(req.engine.tok)
        self.stop = StopMatcher(p.stop)
        self.stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.engine.eos))
        self.routing = None
        self.prev_row = None  # the logits of the last prompt token of the previous chunk (prompt logprobs)
        self.prompt_lp: list | None = [None] if p.prompt_logprobs is not None else None

    @property
    def remaining(self) -> int:
        return len(self.req.prompt) - self.done_prompt


class Engine:
    """Continuous batching over one model (see the module docstring for the policy).

    ``model``, ``tok``: a loaded model and its tokenizer; ``slots``: sequences decoded together at most; ``context``:
    tokens per sequence, prompt and completion together; ``max_queue``: requests waiting at most (more: QueueFull);
    ``expert_stats``: count every token's routed experts per MoE layer (``expert_counts``; on the numba backend the
    one-sequence compiled decode step does not show its routing, so it is turned off; on a device the decode step
    is not recorded). ``telemetry``: an object with the hooks ``toolkit.serve.metrics.Metrics`` has, or None."""

    def __init__(self, model, tok, slots: int = 16, context: int | None = None, max_queue: int = 64,
                 prefill_chunk: int = 512, prefill_tokens: int = 2048, expert_stats: bool = True, telemetry=None):
        cfg = model.cfg
        self.model, self.tok, self.cfg = model, tok, cfg
        self.context = int(context or min(cfg.max_position_embeddings, 4096))
        if not 1 <= self.context <= cfg.max_position_embeddings:
            raise ModelError(f"a context of {self.context} tokens: the model takes 1 .. {cfg.max_position_embeddings}")
        for name, v, lo in (("slots", slots, 1), ("max_queue", max_queue, 0), ("prefill_chunk", prefill_chunk, 1),
                            ("prefill_tokens", prefill_tokens, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ModelError(f"{name} must be a whole number >= {lo}, got {v!r}")
        self.slots, self.max_queue = slots, max_queue
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.eos = tuple(cfg.eos_token_ids)
        self.cache = model.new_cache(slots, self.context)
        self._views: dict = {}
        self.telemetry = telemetry
        self.waiting: collections.deque = collections.deque()  # requests not started
        self.running: list[_Seq] = []  # decoding, in slots 0 .. len-1 (slot = index)
        self.prefill: list[_Seq] = []  # the prefill batch, longest prompt first
        self._aborts: set = set()
        self._cv = threading.Condition()
        self._closed = False
        self.steps = 0
        self.decode_steps = self.decode_rows = 0  # decode steps run, and the sequences they ran (mean batch)
        self.moe_layers = [i for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "experts")]
        self.expert_counts = np.zeros((len(self.moe_layers), cfg.num_experts or 0), np.int64)  # [L, E]
        self._call = None  # (sequences by row block, T, lengths) of the model call under way
        self._watch = None
        if expert_stats and self.moe_layers:
            from ..quant.trace import watching_experts

            self._restore = (model.compiled_decode, model.record_decode)
            model.compiled_decode = "off"  # its one fused call would hide the routing from the hook
            model.record_decode = False  # a recorded step would not call the hook on replay
            self._watch = watching_experts(model, self._see)
            self._watch.__enter__()
        self._thread = threading.Thread(target=self._loop, name="moqe-engine", daemon=True)
        self._thread.start()

    # ---- the caller's side (any thread) -----------------------------------------------------------------------
    def submit(self, prompt: list, params: GenParams, n: int = 1, on_event=None) -> Request:
        """Queue ``n`` sequences of ``prompt`` (token ids). Raises ModelError for what cannot run (prompt plus
        ``max_tokens`` past the context, more sequences than slots, ids outside the vocabulary) and QueueFull."""
        if not prompt:
            raise ModelError("the prompt has no tokens")
        V = self.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ModelError(f"prompt token ids must lie in [0, {V}); got {min(prompt)}..{max(prompt)}")
        need = len(prompt) + params.max_tokens
        if need > self.context:
            raise ModelError(f"this server's context is {self.context} tokens; the request needs {need} "
                             f"({len(prompt)} in the prompt + {params.max_tokens} max_tokens)")
        if not 1 <= n <= self.slots:
            raise ModelError(f"n={n}: this server runs at most {self.slots} sequences at once")
        req = Request(self, prompt, params, n, on_event or (lambda ev: None))
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine has stopped")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); try again later")
            self.waiting.append(req)
            self._cv.notify()
        self._tel("queued", req)
        return req

    def generate(self, prompt: list, params: GenParams, n: int = 1, timeout: float = 600.0):
        """Submit and yield the events as they come (a blocking iterator for scripts and the app)."""
        import queue

        q: queue.Queue = queue.Queue()
        req = self.submit(prompt, params, n, q.put)
        left = n
        try:
            while left:
                ev = q.get(timeout=timeout)
                left -= ev.finish is not None
                yield ev
        finally:
            req.abort()

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
            self.model.compiled_decode, self.model.record_decode = self._restore

    def state(self) -> dict:
        """Queue, batch and cache use now (the /metrics gauges)."""
        with self._cv:
            used = len(self.running) + len(self.prefill)
            held = int(self.cache.lens[:used].sum())
            return {"waiting": sum(len(r.seqs) for r in self.waiting), "running": len(self.running),
                    "prefilling": len(self.prefill), "slots": self.slots, "slots_used": used,
                    "cache_tokens": held, "cache_capacity": self.slots * self.context}

    def _abort(self, req: Request) -> None:
        with self._cv:
            if req in self.waiting:
                self.waiting.remove(req)
                gone = True
            else:
                self._aborts.update(s for s in req.seqs if not s.finished)
                gone = False
            self._cv.notify()
        if gone:
            for s in req.seqs:
                self._finish(s, "abort")

    # ---- the engine thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self.waiting or self.running or self.prefill or self._aborts):
                    self._cv.wait()
                if self._closed:
                    break
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - one bad step fails what ran in it; the engine goes on
                self._fail_all(f"{type(e).__name__}: {e}")
        self._fail_all("the server is shutting down", queued=True)

    def _iteration(self) -> None:
        self._take_aborts()
        if not self.prefill:
            self._form_prefill()
        if self.prefill:
            self._prefill_chunk()
        if self.running:
            self._decode_step()
        self.steps += 1

    def _take_aborts(self) -> None:
        with self._cv:
            gone, self._aborts = self._aborts, set()
        for s in gone:
            if not s.finished:
                self._finish(s, "abort")
        self._compact()

    def _form_prefill(self) -> None:
        with self._cv:
            free = self.slots - len(self.running)
            batch, tokens = [], 0
            while self.waiting:
                req = self.waiting[0]
                n, p = len(req.seqs), len(req.prompt) * len(req.seqs)
                if n > free - len(batch) or (batch and tokens + p > self.prefill_tokens):
                    break
                self.waiting.popleft()
                batch.extend(req.seqs)
                tokens += p
        if not batch:
            return
        batch.sort(key=lambda s: -len(s.req.prompt))  # longest first: the sequences with prompt left stay a prefix
        lo = len(self.running)
        for i, s in enumerate(batch):
            s.slot = lo + i
        self.cache.reset(lo, lo + len(batch))
        self.prefill = batch
        self._tel("started", batch)

    def _view(self, lo: int, hi: int):
        key = (lo, hi)
        if key not in self._views:
            if len(self._views) > 4 * self.slots:
                self._views.clear()
            self._views[key] = self.cache.view(lo, hi)
        return self._views[key]

    def _prefill_chunk(self) -> None:
        batch = self.prefill
        live = [s for s in batch if s.remaining > 0]  # a prefix of the batch (longest prompt first)
        if live:
            T = min(self.prefill_chunk, max(s.remaining for s in live))
            lengths = np.array([min(s.remaining, T) for s in live], np.int64)  # non-increasing
            now_done = []
            for lo, hi in prefill_groups(lengths, CALL_TOKENS):
                now_done += self._prefill_group(live[lo:hi], lengths[lo:hi])
            self._tel("prefill", int(lengths.sum()))
            for s, row in now_done:
                if s.finished:  # aborted meanwhile
                    continue
                if s.req.params.max_tokens == 0:
                    self._emit(s, Event(s.choice, prompt_logprobs=s.prompt_lp), finish="length")
                else:
                    self._sample_and_emit(s, row)
        if all(s.remaining == 0 or s.finished for s in batch):
            self._join()

    def _prefill_group(self, live: list, lengths: np.ndarray) -> list:
        """One model call over ``live`` (contiguous slots), each its next ``lengths[b]`` prompt tokens, padded to
        the longest; returns (sequence, last logits row) for the sequences whose prompt is now done."""
        T = int(lengths[0])
        tokens = np.zeros((len(live), T), np.int64)
        for b, s in enumerate(live):
            tokens[b, : lengths[b]] = s.req.prompt[s.done_prompt : s.done_prompt + lengths[b]]
        full = any(s.prompt_lp is not None for s in live)
        lo = live[0].slot
        self._call = (live, T, lengths)
        try:
            logits = self.model.forward(tokens, self._view(lo, lo + len(live)), lengths=lengths, last_only=not full)
        finally:
            self._call = None
        logits = self._host(logits)  # [B, V] or [B, T, V]
        now_done = []
        for b, s in enumerate(live):
            n = int(lengths[b])
            rows = logits[b, :n] if full else None
            if s.prompt_lp is not None:
                self._prompt_logprobs(s, rows, tokens[b, :n])
            s.done_prompt += n
            if s.remaining == 0:
                now_done.append((s, rows[n - 1] if full else logits[b]))
        return now_done

    def _join(self) -> None:
        """The prefill batch joins the running sequences, moved down to the first free slots."""
        moves = []
        for s in self.prefill:
            if s.finished:
                continue
            dst = len(self.running)
            if s.slot != dst:
                moves.append((s.slot, dst))
                s.slot = dst
            self.running.append(s)
        self.cache.move(moves)
        self.prefill = []

    def _decode_step(self) -> None:
        seqs = self.running
        tokens = np.array([s.out[-1] for s in seqs], np.int64)
        self._call = (seqs, 1, np.ones(len(seqs), np.int64))
        t0 = time.monotonic()
        try:
            logits = self._host(self.model.decode(tokens, self._view(0, len(seqs))))  # [d, V]
        finally:
            self._call = None
        self._tel("decode", len(seqs), time.monotonic() - t0)
        self.decode_steps += 1
        self.decode_rows += len(seqs)
        for b, s in enumerate(seqs):
            if not s.finished:
                self._sample_and_emit(s, logits[b])
        self._compact()

    def _compact(self) -> None:
        """Finished sequences leave the running slots; the last running sequences move into their slots."""
        if not any(s.finished for s in self.running):
            return
        alive = [s for s in self.running if not s.finished]
        d = len(alive)
        holes = iter(sorted(s.slot for s in self.running if s.finished and s.slot < d))
        moves = []
        for s in alive:
            if s.slot >= d:
                dst = next(holes)
                moves.append((s.slot, dst))
                s.slot = dst
        self.cache.move(moves)
        self.running = sorted(alive, key=lambda s: s.slot)

    # ---- per sequence ------------------------------------------------------------------------------------------
    def _host(self, logits) -> np.ndarray:
        return self.model.rt.host(logits) if self.model.rt.on_device else np.asarray(logits)

    def _sample_and_emit(self, s: _Seq, row: np.ndarray) -> None:
        p = s.req.params
        x = row
        if p.presence_penalty or p.frequency_penalty or p.logit_bias:
            x = np.array(row, np.float32)
            for t, c in s.counts.items():
                x[t] -= p.presence_penalty + p.frequency_penalty * c
            for t, bias in p.logit_bias.items():
                x[t] += bias
        seen = np.asarray(s.seen, np.int64) if s.sampling.repetition_penalty != 1.0 else _NONE_SEEN  # read only then
        tok = sample_token(x, seen, s.sampling, s.rng)
        s.seen.append(tok)
        s.counts[tok] = s.counts.get(tok, 0) + 1
        if s.req.first_token_at is None:
            s.req.first_token_at = time.monotonic()
            self._tel("first_token", s.req)
        ev = Event(s.choice, prompt_logprobs=s.prompt_lp if not s.out else None)
        s.out.append(tok)
        finish = None
        if tok in s.stops:
            finish = "stop"
        else:
            ev.tokens = [tok]
            if p.logprobs is not None:
                ev.logprobs = [_logprob(row, tok, p.logprobs)]
            text, hit = s.stop.feed(s.detok.add(tok))
            ev.text = text
            if hit:
                finish = "stop"
        if finish is None and len(s.out) >= p.max_tokens:
            finish = "length"
        if finish == "length" or tok in s.stops:  # no stop string cut the text: what was held back goes out
            ev.text += s.stop.flush(s.detok.flush())
        self._tel("token", s.req)
        self._emit(s, ev, finish)

    def _prompt_logprobs(self, s: _Seq, rows: np.ndarray, toks: np.ndarray) -> None:
        """Each prompt token's logprob given the ones before it: the previous chunk's last row predicts this chunk's
        first token."""
        k = s.req.params.prompt_logprobs
        start = 1 if s.done_prompt == 0 else 0
        prev = [s.prev_row] if s.prev_row is not None else []
        preds = list(prev) + [rows[i] for i in range(len(toks) - 1)]  # the row predicting toks[start:]
        for j, t in enumerate(toks[start:]):
            s.prompt_lp.append(_logprob(preds[j], int(t), k))
        s.prev_row = np.array(rows[-1])

    def _emit(self, s: _Seq, ev: Event, finish: str | None = None) -> None:
        if finish is not None:
            s.finished = True
            ev.finish = finish
            ev.completion_tokens = len(s.out)
            if s.routing is not None:
                ev.routing = s.routing
        try:
            s.req.on_event(ev)
        except Exception:  # noqa: BLE001 - a listener's failure (a closed loop) must not stop the engine
            if not s.finished:
                with self._cv:
                    self._aborts.add(s)
        if finish is not None:
            self._tel("finished", s.req, finish, len(s.out))

    def _finish(self, s: _Seq, reason: str, error: str = "") -> None:
        if not s.finished:
            self._emit(s, Event(s.choice, error=error, text=s.stop.flush(s.detok.flush()) if reason != "error" else ""),
                       reason)

    def _fail_all(self, message: str, queued: bool = False) -> None:
        """A step failed (or the engine stops): every sequence in it ends with the error; the cache starts empty."""
        seqs = self.running + self.prefill
        if queued:
            with self._cv:
                seqs += [s for r in self.waiting for s in r.seqs]
                self.waiting.clear()
        for s in seqs:
            self._finish(s, "error", message)
        self.running, self.prefill = [], []
        self.cache.reset(0, self.slots)

    # ---- routing counts (the experts' hook) ----------------------------------------------------------------
    def _see(self, i, x, ids, wts) -> None:
        call = self._call
        if call is None:
            return
        seqs, T, lengths = call
        got = np.asarray(self.model.rt.host(ids) if self.model.rt.on_device else ids, np.int64)  # [R, A]
        R, B = got.shape[0], len(seqs)
        if R == B * T:
            valid = (np.arange(T)[None, :] < lengths[:, None]).reshape(-1)  # padded rows are not tokens
            owner = np.repeat(np.arange(B), T)
        elif R == B:  # the last layer of a prefill runs on each sequence's last token only
            valid, owner = np.ones(B, bool), np.arange(B)
        else:
            return
        j = self.moe_layers.index(i)
        E = self.expert_counts.shape[1]
        self.expert_counts[j] += np.bincount(got[valid].reshape(-1), minlength=E)
        for b, s in enumerate(seqs):
            if s.req.params.routing:
                if s.routing is None:
                    s.routing = np.zeros_like(self.expert_counts)
                s.routing[j] += np.bincount(got[valid & (owner == b)].reshape(-1), minlength=E)

    def _tel(self, what: str, *args) -> None:
        if self.telemetry is not None:
            getattr(self.telemetry, what)(*args)


def prefill_groups(lengths: np.ndarray, call_tokens: int) -> list:
    """Cut a prefill chunk's rows (token counts ``lengths``, non-increasing) into contiguous groups, one model call
    each, padded to its first row: the cuts that minimise ``sum(call_tokens + rows * longest)`` over the groups
    (dynamic programming over the cut points). Returns [(lo, hi), ...]."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[i]: the cost of rows [0, i)
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            c = best[j] + call_tokens + (i - j) * int(lengths[j])
            if c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], n
    while i:
        groups.append((cut[i], i))
        i = cut[i]
    return groups[::-1]


def _logprob(row: np.ndarray, tok: int, top: int) -> TokenLogprob:
    x = np.asarray(row, np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    out = TokenLogprob(int(tok), float(x[tok] - lse), [])
    if top:
        idx = np.argpartition(-x, min(top, x.size - 1))[:top]
        idx = idx[np.lexsort((idx, -x[idx]))]  # likeliest first, lower id on ties
        out.top = [(int(t), float(x[t] - lse)) for t in idx]
    return out

