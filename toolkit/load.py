"""``load_model``: a Hugging Face MoE checkpoint directory, a UQFF bundle or a GGUF file, on one backend, by path;
in this process (``toolkit.sources``) or with its routed experts on expert ranks (``toolkit.dist``).

It sits above ``toolkit.model`` (the runtime) and ``toolkit.uqff`` (the bundle format), which import
each other's pieces only downwards: the bundle reader builds a model from ``toolkit.model``, and nothing in
``toolkit.model`` reads bundles.
"""
from __future__ import annotations

from pathlib import Path

from .model import MoEModel, Tokenizer
from .sources import load_local


def load_model(directory: str | Path, backend: str = "numba", policy=None, progress: bool = False,
               report=None, kv_cache: str | tuple | None = None, allow_outside: bool = False,
               activations: str | None = None, placement=None, ep=None) -> tuple[MoEModel, Tokenizer]:
    """Load a Hugging Face MoE checkpoint directory (or a UQFF bundle, or a GGUF file) on one backend, quantizing it with ``policy``
    (a :class:`toolkit.quant.Policy`; None keeps full precision) as it streams in.
    Returns (model, tokenizer); ``report`` (a :class:`toolkit.quant.QuantReport`) records the formats.
    A UQFF bundle directory (``toolkit.uqff``) is loaded memory-mapped as written, never requantized.
    Files are read only inside ``directory`` (``allow_outside`` lets symlinks leave it). ``activations``: the
    quantized experts' GEMM activations on numba, 'int8' (None: the default) or 'f32' (exact); on a device they are
    the host experts' when ``placement`` (a :class:`toolkit.model.placement.PlacementSpec`: ``--cpu-moe``,
    ``--n-cpu-moe N``, ``--placement FILE``) keeps routed experts on the host.

    ``ep`` (a :class:`toolkit.dist.EPSpec`): expert parallelism on Ray. The ranks start first, each loading only
    its routed experts from the same file; this process then loads everything but the routed experts, and each
    MoE layer's experts run on the ranks (``model.cluster``: close it, or let the process end)."""
    if ep is not None:
        from .dist import load_distributed

        return load_distributed(directory, ep, backend=backend, policy=policy, progress=progress, report=report,
                                kv_cache=kv_cache, allow_outside=allow_outside, activations=activations,
                                placement=placement)
    return load_local(directory, backend, policy, progress, report, kv_cache, allow_outside, activations, placement)


