"""``load_model``: a Hugging Face MoE checkpoint directory or a UQFF bundle, on one backend, by path.

It sits above ``toolkit.model`` (the runtime) and ``toolkit.uqff`` (the bundle format), which import
each other's pieces only downwards: the bundle reader builds a model from ``toolkit.model``, and nothing in
``toolkit.model`` reads bundles.
"""
from __future__ import annotations

from pathlib import Path

from .backend import resolve_backend
from .model import Checkpoint, MoEModel, Runtime, Tokenizer, load_config, load_weights
from .model.inspect import check_fits
from .model.kv_cache import parse_kv_cache
from .model.placement import resolve_places
from .model.weights import check_layers
from .quant import Policy, quantizing_transform
from .uqff import is_bundle, load_bundle


def load_model(directory: str | Path, backend: str = "numba", policy=None, progress: bool = False,
               report=None, kv_cache: str | tuple | None = None, allow_outside: bool = False,
               activations: str | None = None, placement=None) -> tuple[MoEModel, Tokenizer]:
    """Load a Hugging Face MoE checkpoint directory (or a UQFF bundle, or a GGUF file) on one backend, quantizing it with ``policy``
    (a :class:`toolkit.quant.Policy`; None keeps full precision) as it streams in.
    Returns (model, tokenizer); ``report`` (a :class:`toolkit.quant.QuantReport`) records the formats.
    A UQFF bundle directory (``toolkit.uqff``) is loaded memory-mapped as written, never requantized.
    Files are read only inside ``directory`` (``allow_outside`` lets symlinks leave it). ``activations``: the
    quantized experts' GEMM activations on numba, 'int8' (None: the default) or 'f32' (exact); on a device they are
    the host experts' when ``placement`` (a :class:`toolkit.model.placement.PlacementSpec`: ``--cpu-moe``,
    ``--n-cpu-moe N``, ``--placement FILE``) keeps routed experts on the host."""

    from .gguf.read import is_gguf

    if is_gguf(directory):  # a GGUF model file (llama.cpp's format)
        from .gguf.read import load_gguf

        return load_gguf(directory, resolve_backend(backend), policy=policy, kv_cache=kv_cache, report=report,
                         activations=activations, placement=placement)
    if is_bundle(directory):
        return load_bundle(directory, backend, kv_cache=kv_cache, report=report, policy=policy,
                           allow_outside=allow_outside, activations=activations, placement=placement)

    backend = resolve_backend(backend)
    parse_kv_cache(kv_cache)  # a bad cache type fails before the weights are read
    cfg = load_config(directory, allow_outside)
    if policy is not None:
        policy, _ = policy.fit(cfg)  # a format named without a group size takes one that divides the model
    check_fits(cfg, policy, Path(directory) / "config.json")
    places = resolve_places(placement, cfg, backend)  # refused before any weight is read
    ck = Checkpoint(directory, allow_outside)
    check_layers(ck, cfg)
    tok = Tokenizer(directory, cfg.bos_token_id, cfg.eos_token_ids, allow_outside)
    transform = Runtime(backend, activations, places).placing(quantizing_transform(policy or Policy(), backend, report), cfg)
    if progress:
        from tqdm import tqdm

        with tqdm(total=cfg.num_layers, desc="loading layers", unit="layer") as bar:  # closed before any error shows
            weights = load_weights(ck, cfg, transform=transform, progress=bar)
    else:
        weights = load_weights(ck, cfg, transform=transform)
    return MoEModel(cfg, weights, backend, kv_cache=kv_cache, activations=activations, places=places), tok
