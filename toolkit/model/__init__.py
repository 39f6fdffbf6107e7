"""The MoE runtime: configuration, checkpoint reading, the model, generation and perplexity."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import Checkpoint
from .config import ModelConfig, load_config
from .generate import TokenEvent, generate_tokens, perplexity
from .model import MoEModel
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .weights import load_weights


def load_model(directory: str | Path, backend: str = "numba", policy=None, progress: bool = False,
               report=None, kv_cache: str | tuple | None = None) -> tuple[MoEModel, Tokenizer]:
    """Load a Hugging Face MoE checkpoint directory on one backend, quantizing it with ``policy``
    (a :class:`toolkit.quant.Policy`; None keeps full precision) as it streams in.
    Returns (model, tokenizer); ``report`` (a :class:`toolkit.quant.QuantReport`) records the formats.
    A UQFF bundle directory (``toolkit.uqff``) is loaded memory-mapped as written, never requantized."""
    from ..backend import resolve_backend
    from ..quant import Policy, quantizing_transform
    from ..uqff import is_bundle, load_bundle

    if is_bundle(directory):
        return load_bundle(directory, backend, kv_cache=kv_cache, report=report, policy=policy)

    backend = resolve_backend(backend)
    cfg = load_config(directory)
    ck = Checkpoint(directory)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.num_layers, desc="loading layers", unit="layer")
    transform = quantizing_transform(policy or Policy(), backend, report)
    weights = load_weights(ck, cfg, transform=transform, progress=bar)
    if bar is not None:
        bar.close()
    tok = Tokenizer(directory, cfg.bos_token_id, cfg.eos_token_ids)
    return MoEModel(cfg, weights, backend, kv_cache=kv_cache), tok


__all__ = ["Checkpoint", "ModelConfig", "MoEModel", "SamplingParams", "TokenEvent", "Tokenizer",
           "generate_tokens", "load_config", "load_model", "load_weights", "perplexity"]
