"""An expert rank: one process that loads only its routed experts, from the same file as the driver, and runs
them for the rows the driver sends (``toolkit/dist/cluster.py`` makes it a Ray actor).

A message is ``(layer, x [n, D], ids [n, A], weights [n, A])``: the hidden rows of the tokens routed to at least
one of this rank's experts in that layer, with their global expert ids and routing weights; the answer is
``[n, D]``, those rows' sum over this rank's experts (``fused_moe`` with an ``expert_map``: a slot routed to
another rank's expert adds nothing here).
"""
from __future__ import annotations

import os
import resource
import socket
import time
from collections import deque

import numpy as np

WARM_ROWS = (1, 4, 40)  # rows of the warm-up calls: one token, the few-rows path, a prefill's


def peak_rss() -> int:
    """This process's peak resident set, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def numpy_channels() -> None:
    """Tell this process's Ray Compiled Graph channels that torch is absent. Where torch is installed, Ray imports it
    in every process that runs a compiled graph, to offer torch-tensor transport (NCCL). Our hops send NumPy arrays,
    so the import only cost each rank ~4 s of CPU before its first hop (the driver spinning on the channel meanwhile)
    and torch's memory. It sets a private field of Ray's ``ChannelContext`` (a DeveloperAPI); where a Ray version
    lacks it, nothing changes but the time."""
    try:
        from ray.experimental.channel.common import ChannelContext

        ctx = ChannelContext.get_current()
    except Exception:  # another Ray layout: torch is imported as before
        return
    if hasattr(ctx, "_torch_available"):
        ctx._torch_available = False


class ExpertRank:
    """``ids``: ``{layer: global expert ids}`` this rank holds; ``E`` experts per layer."""

    def __init__(self, source: str, rank: int, ids: dict, E: int, backend: str = "numba", policy=None,
                 activations=None, allow_outside: bool = False, threads: int | None = None, fail: str | None = None):
        from ..sources import model_weights
        from ..model.moe import mapped_experts
        from ..model.runtime import Runtime
        from ..model.shard import ExpertShard
        from ..threads import set_threads

        t0 = time.perf_counter()
        if fail:  # a test's way to make one rank's start fail (a missing file, no memory): the reason is raised
            raise RuntimeError(fail)
        set_threads(threads)
        numpy_channels()  # before the compiled graph's loop starts in this process
        self.rank, self.pid, self.host = rank, os.getpid(), socket.gethostname()
        self.rss_start = rss()  # before any weight is read: the load's growth is measured from here
        shard = ExpertShard.rank(ids, E)
        cfg, w = model_weights(source, backend, policy, allow_outside, activations, shard)
        self.rt = rt = Runtime(backend, activations)
        self.D = cfg.hidden_size
        self.layers = {}
        for i, lw in enumerate(w.layers):
            if lw.moe is None or i not in shard.ids:
                continue
            m = lw.moe
            bias = None
            if m.get("gate_up_bias") is not None:
                bias = (shard.select(m["gate_up_bias"], i), shard.select(m["down_bias"], i))
            self.layers[i] = mapped_experts(rt, m["gate_up"], m["down"], shard.ids[i], E, bias, cfg.expert_act)
        del w
        self.expert_bytes = sum(f.nbytes for f in self.layers.values())
        self.load_peak = peak_rss()  # the peak by the end of the load (before the kernels' warm-up)
        self._warm(shard, cfg.top_k)
        self.run_s = deque(maxlen=4096)  # seconds of the latest calls' expert compute (the bench splits a hop by it)
        self.load_s = time.perf_counter() - t0

    def _warm(self, shard, A: int):
        """Run one layer at the row counts of a decode step, a batched step and a prefill chunk, so the kernels are
        compiled (or loaded from Numba's disk cache) before the first hop, whose timeout then measures the hop."""
        for i, f in list(self.layers.items())[:1]:
            e = int(shard.ids[i][0])
            for T in WARM_ROWS:
                x = np.zeros((T, self.D), np.float32)
                f(self.rt.weight(x), self.rt.weight(np.full((T, A), e), np.int32), self.rt.weight(np.ones((T, A), np.float32)))

    def run(self, msg):
        """``(layer, x [n, D], ids [n, A], weights [n, A])`` -> ``[n, D]`` f32."""
        layer, x, ids, wts = msg
        if x.shape[0] == 0:
            return np.zeros((0, self.D), np.float32)
        rt, t0 = self.rt, time.perf_counter()
        y = self.layers[layer](rt.weight(x), rt.weight(ids, np.int32), rt.weight(wts))
        out = np.asarray(rt.host(y), np.float32)
        self.run_s.append(time.perf_counter() - t0)
        return out

    def info(self) -> dict:
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "expert_bytes": self.expert_bytes,
                "layers": len(self.layers), "load_s": self.load_s, "peak_rss": peak_rss(),
                "run_s": float(np.median(self.run_s)) if self.run_s else None, "runs": len(self.run_s), "rss": rss(), "rss_start": self.rss_start,
                "load_peak": self.load_peak}
