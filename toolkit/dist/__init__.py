"""Expert parallelism on Ray (issue 35): routed experts on ``N`` expert ranks, each loading only its own experts
from the same checkpoint, UQFF bundle or GGUF file; the driver keeps attention, router, shared experts, norms,
embeddings, head and the KV cache, and holds no routed expert (attention-expert disaggregation).

``load_distributed`` (what ``load_model(..., ep=EPSpec(N))`` and ``--ep N`` call) starts the ranks, loads the
driver's share while they load theirs, and wires each MoE layer's experts to ``Cluster.call``: one hop per layer,
a Ray Compiled Graph sending each rank the rows routed to its experts. See docs/expert-parallel.md.
"""
from __future__ import annotations

import numpy as np

from .cluster import Cluster, EPSpec, RankError
from .split import ExpertSplit, balanced, contiguous, split_for

__all__ = ["Cluster", "EPSpec", "ExpertSplit", "RankError", "balanced", "contiguous", "load_distributed", "source_config",
           "split_for"]


def source_config(source, allow_outside: bool = False):
    """The ModelConfig of a checkpoint directory, UQFF bundle or GGUF file, no weight read."""
    from ..gguf.read import _config, is_gguf, open_gguf
    from ..model import load_config

    if is_gguf(source):
        return _config(open_gguf(source, str(source)), str(source))[0]
    return load_config(source, allow_outside)


def remote_experts(cluster: Cluster, layer: int):
    """Layer ``layer``'s routed experts as the MoE block calls them, run on the ranks: ``(x [T, D], ids [T, A],
    weights [T, A]) -> [T, D]`` in the driver's arrays (``experts.rt``: the driver model's Runtime, set once built)."""
    def experts(x, ids, wts):
        rt = experts.rt
        y = cluster.call(layer, np.asarray(rt.host(x), np.float32), np.asarray(rt.host(ids)), np.asarray(rt.host(wts), np.float32))
        return rt.weight(y) if rt.on_device else y

    experts.nbytes = 0  # the driver holds none of them
    experts.remote = cluster
    return experts


def load_distributed(directory, ep: EPSpec, backend: str = "numba", policy=None, progress: bool = False, report=None,
                     kv_cache=None, allow_outside: bool = False, activations=None, placement=None):
    """(MoEModel, Tokenizer) whose routed experts run on ``ep.ranks`` Ray actors; ``model.cluster`` is the
    :class:`Cluster` (``close()`` ends the ranks; the process's exit does too)."""
    from ..backend import resolve_backend
    from ..errors import ModelError
    from ..sources import load_local
    from ..model.shard import ExpertShard

    if placement is not None and getattr(placement, "given", True):
        raise ModelError("--ep puts the routed experts on the expert ranks; a placement (--cpu-moe, --n-cpu-moe, "
                         "--placement) says the same thing another way: give one")
    backend = resolve_backend(backend)
    cfg = source_config(directory, allow_outside)
    if policy is not None:
        policy, _ = policy.fit(cfg)
    split = split_for(cfg, ep.ranks, ep.split)
    if backend == "numba":  # the ranks run what this process would: its default activation kind, named
        from ..cpu.moe_gemm import check_activations

        activations = check_activations(activations)
    cluster = Cluster(ep, directory, split, cfg.num_experts, cfg.hidden_size, backend, policy, activations, allow_outside)
    try:  # the ranks load while this process loads its share
        moe = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
        experts = {i: remote_experts(cluster, i) for i in moe}
        model, tok = load_local(directory, backend, policy, progress, report, kv_cache, allow_outside, activations,
                                shard=ExpertShard.driver(moe, cfg.num_experts), experts=experts)
        for f in experts.values():
            f.rt = model.rt
        cluster.wait_ready()
    except BaseException:
        cluster.close()
        raise
    model.cluster = cluster
    model.split = split
    return model, tok
