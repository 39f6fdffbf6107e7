"""The server's Prometheus metrics (``/metrics``), in a registry of its own (two servers in one process do not mix).

Counters: requests by how they finished, prompt and generated tokens, and ``moqe_expert_routed_tokens_total``
by MoE layer and expert: every token the experts ran on (the routing the placement planner wants; on a prefill,
the last MoE layer runs on each prompt's last token only). Gauges, read when scraped: the queue, the running
batch, the prefill batch, KV cache slots and tokens. Histograms: time to first token, time per output token
(between a sequence's tokens), request latency, and the batch size of each decode step.
"""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)


class Metrics:
    """The engine's telemetry hooks (``Engine(telemetry=...)``) and the registry that ``/metrics`` renders."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.engine = None
        r, lab = self.registry, ["model_name"]
        self.name = model_name
        self.requests = Counter("moqe_requests", "Sequences finished, by reason (stop, length, abort, error)",
                                lab + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("moqe_prompt_tokens", "Prompt tokens prefilled", lab, registry=r)
        self.generation_tokens = Counter("moqe_generation_tokens", "Tokens generated", lab, registry=r)
        self.ttft = Histogram("moqe_time_to_first_token_seconds", "From arrival to a request's first token",
                              lab, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("moqe_time_per_output_token_seconds", "Between two tokens of one request",
                              lab, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moqe_e2e_request_latency_seconds", "From arrival to a request's last token", lab,
                             buckets=TTFT_BUCKETS, registry=r)
        self.batch = Histogram("moqe_decode_batch_size", "Sequences in each decode step", lab,
                               buckets=(1, 2, 4, 8, 12, 16, 24, 32, 64, 128), registry=r)
        self.step = Histogram("moqe_decode_step_seconds", "Time of each decode step", lab, buckets=LATENCY_BUCKETS,
                              registry=r)
        self._last: dict = {}  # request -> time of its last token
        self._lock = threading.Lock()
        r.register(_Live(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the engine's hooks (its thread) ------------------------------------------------------------------
    def queued(self, req) -> None:
        pass

    def started(self, seqs) -> None:
        pass

    def prefill(self, tokens: int) -> None:
        self.prompt_tokens.labels(self.name).inc(tokens)

    def decode(self, batch: int, seconds: float) -> None:
        self.batch.labels(self.name).observe(batch)
        self.step.labels(self.name).observe(seconds)

    def first_token(self, req) -> None:
        self.ttft.labels(self.name).observe(req.first_token_at - req.arrived)

    def token(self, req) -> None:
        now = time.monotonic()
        self.generation_tokens.labels(self.name).inc()
        with self._lock:
            last = self._last.get(req)
            self._last[req] = now
        if last is not None:
            self.tpot.labels(self.name).observe(now - last)

    def finished(self, req, reason: str, tokens: int) -> None:
        self.requests.labels(self.name, reason).inc()
        if all(s.finished for s in req.seqs):
            with self._lock:
                self._last.pop(req, None)
            self.e2e.labels(self.name).observe(time.monotonic() - req.arrived)


class _Live:
    """Gauges and the expert counts, read from the engine when scraped."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        e, name = self.m.engine, self.m.name
        if e is None:
            return
        st = e.state()
        for key, doc in (("waiting", "Sequences waiting in the queue"), ("running", "Sequences in the decode batch"),
                         ("prefilling", "Sequences in the prefill batch"), ("slots_used", "KV cache slots in use"),
                         ("slots", "KV cache slots"), ("cache_tokens", "Tokens held in the KV cache"),
                         ("cache_capacity", "Tokens the KV cache can hold")):
            g = GaugeMetricFamily(f"moqe_{key}", doc, labels=["model_name"])
            g.add_metric([name], st[key])
            yield g
        g = GaugeMetricFamily("moqe_kv_cache_usage_ratio", "Share of the KV cache's tokens in use", labels=["model_name"])
        g.add_metric([name], st["cache_tokens"] / max(1, st["cache_capacity"]))
        yield g
        c = CounterMetricFamily("moqe_expert_routed_tokens", "Tokens routed to each expert, by MoE layer",
                                labels=["model_name", "layer", "expert"])
        counts = e.expert_counts.copy()  # [L, E]
        for j, layer in enumerate(e.moe_layers):
            for x in range(counts.shape[1]):
                c.add_metric([name, str(layer), str(x)], float(counts[j, x]))
        yield c
