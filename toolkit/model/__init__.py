"""The MoE runtime: configuration, checkpoint reading, the model, generation and perplexity.

Loading a model directory or a UQFF bundle by path is ``toolkit.load.load_model`` (above this package and
``toolkit.uqff``, which both sit below it)."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import Checkpoint
from .config import ModelConfig, load_config
from .kv_cache import parse_kv_cache
from .generate import TokenEvent, generate_tokens, perplexity
from .model import MoEModel
from .runtime import Runtime
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .weights import check_layers, load_weights


__all__ = ["Checkpoint", "ModelConfig", "MoEModel", "SamplingParams", "TokenEvent", "Tokenizer",
           "generate_tokens", "load_config", "load_weights", "perplexity"]
