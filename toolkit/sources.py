"""Reading a model source (a Hugging Face checkpoint directory, a UQFF bundle or a GGUF file) in this process: the
model and tokenizer (``load_local``), or only the weights, all or one process's share of an expert-parallel run
(``model_weights``). Below ``toolkit.load`` (``load_model``) and ``toolkit.dist``, which both build on it.
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


def load_local(directory, backend: str = "numba", policy=None, progress: bool = False, report=None, kv_cache=None,
               allow_outside: bool = False, activations=None, placement=None, shard=None, experts=None):
    """``load_model`` in this process; ``shard`` (an ExpertShard): read only its share, ``experts`` ({layer:
    callable}): the MoE layers' routed experts run elsewhere (an expert-parallel driver's)."""
    from .gguf.read import is_gguf

    if is_gguf(directory):  # a GGUF model file (llama.cpp's format)
        from .gguf.read import load_gguf

        return load_gguf(directory, resolve_backend(backend), policy=policy, kv_cache=kv_cache, report=report,
                         activations=activations, placement=placement, shard=shard, experts=experts)
    if is_bundle(directory):
        return load_bundle(directory, backend, kv_cache=kv_cache, report=report, policy=policy,
                           allow_outside=allow_outside, activations=activations, placement=placement, shard=shard,
                           experts=experts)

    backend = resolve_backend(backend)
    parse_kv_cache(kv_cache)  # a bad cache type fails before the weights are read
    cfg, weights, places, tok = checkpoint_weights(directory, backend, policy, progress, report, allow_outside,
                                                   activations, placement, shard, tokenizer=True)
    return MoEModel(cfg, weights, backend, experts=experts, kv_cache=kv_cache, activations=activations,
                    places=places), tok


def checkpoint_weights(directory, backend: str, policy=None, progress: bool = False, report=None,
                       allow_outside: bool = False, activations=None, placement=None, shard=None, tokenizer=False):
    """A Hugging Face checkpoint's (ModelConfig, ModelWeights, Places, Tokenizer or None), quantized by ``policy``
    as it streams in; the tokenizer (with ``tokenizer``) is read before the weights, so a broken one fails first."""
    cfg = load_config(directory, allow_outside)
    if policy is not None:
        policy, _ = policy.fit(cfg)  # a format named without a group size takes one that divides the model
    check_fits(cfg, policy, Path(directory) / "config.json")
    places = resolve_places(placement, cfg, backend)  # refused before any weight is read
    ck = Checkpoint(directory, allow_outside)
    check_layers(ck, cfg)
    tok = Tokenizer(directory, cfg.bos_token_id, cfg.eos_token_ids, allow_outside) if tokenizer else None
    transform = Runtime(backend, activations, places).placing(quantizing_transform(policy or Policy(), backend, report),
                                                               cfg, shard)
    if progress:
        from tqdm import tqdm

        with tqdm(total=cfg.num_layers, desc="loading layers", unit="layer") as bar:  # closed before any error shows
            return cfg, load_weights(ck, cfg, transform=transform, progress=bar), places, tok
    return cfg, load_weights(ck, cfg, transform=transform), places, tok


def model_weights(directory, backend: str = "numba", policy=None, allow_outside: bool = False, activations=None,
                  shard=None):
    """(ModelConfig, ModelWeights) of a checkpoint, bundle or GGUF file, reading only ``shard``'s share (an expert
    rank's routed experts)."""
    from .gguf.read import gguf_weights, is_gguf
    from .uqff.reader import bundle_weights

    backend = resolve_backend(backend)
    if is_gguf(directory):
        cfg, weights, _, _ = gguf_weights(directory, backend, policy, activations=activations, shard=shard)
    elif is_bundle(directory):
        cfg, weights, _, _ = bundle_weights(directory, backend, policy=policy, allow_outside=allow_outside,
                                            activations=activations, shard=shard)
    else:
        cfg, weights, _, _ = checkpoint_weights(directory, backend, policy, allow_outside=allow_outside,
                                             activations=activations, shard=shard)
    return cfg, weights
