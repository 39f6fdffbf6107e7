"""Read a checkpoint's tensors into the runtime's per-layer weights, one tensor at a time.

Experts are stacked ``gate_up [E, 2I, D]`` (gate rows, then up rows) and ``down [E, D, I]`` whichever of
the two checkpoint layouts holds them: per expert (``experts.N.w1/w3/w2`` or ``gate/up/down_proj``) or
fused as transformers 5 keeps them in memory (``experts.gate_up_proj``, ``experts.down_proj``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..errors import ModelError
from ..families.parts.loading import expected_shape, shape_at, where
from .checkpoint import Checkpoint
from .config import ModelConfig


@dataclass
class LayerWeights:
    """Dense weights of one decoder layer in f32 (expert weights may be replaced by quantized tensors)."""

    attn_norm: np.ndarray  # [D]
    ffn_norm: np.ndarray  # [D]
    attn: dict  # q, k, v, o: [out, in]; q_bias, k_bias, v_bias (o_bias): [out] when the family has them;
    #              q_norm, k_norm: [hd] or [H*hd] / [Hkv*hd] for families with q/k norms;
    #              MLA: q or q_a/q_b, kv_a, kv_b, o, q_a_norm, kv_a_norm (toolkit/families/parts/attention.py)
    moe: dict | None = None  # router [E, D] (router_bias [E]: a logit bias; select_bias [E]: a selection bias), gate_up [E, 2I, D], down [E, D, I]; shared_* when present
    mlp: dict | None = None  # dense MLP layers: gate_up [2I, D], down [D, I]


@dataclass
class ModelWeights:
    embed: np.ndarray  # [V, D]
    norm: np.ndarray  # [D]
    lm_head: np.ndarray  # [V, D]
    layers: list[LayerWeights] = field(default_factory=list)


@dataclass(frozen=True)
class LayerSource:
    """One checkpoint layer as the parts read it: ``get(name)`` loads a tensor as f32, ``p`` is the layer's prefix."""

    ck: Checkpoint
    get: Callable
    cfg: ModelConfig
    i: int
    p: str


def iter_layer_tensors(ck: Checkpoint, cfg: ModelConfig, i: int) -> Iterator[tuple[str, str, Callable[[], np.ndarray], tuple]]:
    """Yield ``(role, checkpoint name, loader, shape)`` for every weight of layer ``i``, as the family's parts name
    them (``toolkit/families/parts``): norms, attention, then the dense MLP or the router and the experts.

    ``loader()`` returns f32 ``shape``; for stacked expert roles (``[E, out, in]``) ``loader(e)`` returns
    expert ``e`` alone, so a quantizer can stream expert by expert.
    """
    fam = cfg.family
    t = LayerSource(ck, ck.get_f32, cfg, i, f"model.layers.{i}")
    yield from fam.layers.hf_norms(t)
    yield from fam.attention.hf_tensors(t)
    if not cfg.moe_layers[i]:
        yield from fam.layers.hf_mlp(t)
        return
    r, prefixes = fam.router.module, fam.experts.prefixes
    prefix = next((f"{t.p}.{m}" for m in prefixes if f"{t.p}.{m}.{r}.weight" in ck), None)
    if prefix is None:
        raise ModelError(f"{ck.dir}: no router for layer {i} (looked for "
                         f"{', '.join(f'{t.p}.{m}.{r}.weight' for m in prefixes)})")
    yield from fam.router.hf_tensors(t, prefix)
    yield from fam.experts.hf_tensors(t, prefix)


def _checked(name, load, shape, ck):
    """Wrap a loader so whatever it returns is checked against the shape the config implies (errors name the
    file holding the tensor)."""

    def checked(e=None):
        try:
            if e is None:
                return expected_shape(name, load(), shape)
            return expected_shape(name.replace("*", str(e)), load(e), shape[1:])
        except ModelError as err:
            msg = str(err)
            if msg.startswith("tensor "):  # a shape error: say where the tensor lives
                bad = msg.split("'")[1]
                raise ModelError(f"{where(ck, bad)}: {msg}") from None
            raise

    checked.__wrapped__ = load  # its signature is the loader's: whether it reads one expert at a time (model/shard.py)
    if hasattr(load, "qtensor"):  # a weight stored quantized (MXFP4 experts): kept as stored when the policy allows
        checked.qtensor = load.qtensor
    if len(shape) == 2:  # a projection the runtime may keep as the file stores it (Runtime.placing)
        checked.table16 = lambda: _stored16(ck, name, shape)
    return checked


def _stored16(ck, name: str, shape: tuple):
    """``name`` as the file stores it when that is f16 / bf16 of ``shape`` (a view, nothing read), else None (a
    tensor the checkpoint does not hold under that name, e.g. a slice of a fused one, or another dtype)."""
    from .runtime import table16

    if name not in ck:
        return None
    view = ck.stored(name) if hasattr(ck, "stored") else ck.get(name)
    return None if view is None or tuple(view.shape) != tuple(shape) else table16(view, shape)


def check_layers(ck, cfg: ModelConfig) -> None:
    """Refuse a config that declares more layers than the checkpoint holds, before anything is read."""
    held = ck.layer_count() if hasattr(ck, "layer_count") else cfg.num_layers
    if held < cfg.num_layers:
        raise ModelError(f"{ck.dir}: config.json declares {cfg.num_layers} layers (num_hidden_layers), "
                         f"the checkpoint holds {held} (model.layers.0 .. {held - 1})" if held else
                         f"{ck.dir}: config.json declares {cfg.num_layers} layers, the checkpoint holds no model.layers.* tensor")


def _table(ck, name: str, shape: tuple):
    """The loader of an embedding table / LM head: ``load()`` reads it as f32 (checked), ``load.table16()`` offers
    it as stored when the file holds it in f16 / bf16 (a view of the mapped file, nothing read: the runtime may
    keep it so, ``Runtime.placing``), else None. Its presence and shape are checked now, from the stored view."""
    from .runtime import table16

    view = ck.stored(name) if hasattr(ck, "stored") else ck.get(name)  # None: not stored as a plain tensor
    if view is not None:
        shape_at(ck, name, view, shape)

    def load():
        return shape_at(ck, name, ck.get_f32(name), shape)

    load.table16 = lambda: None if view is None else table16(view, shape)
    return load


def load_weights(ck: Checkpoint, cfg: ModelConfig, transform: Callable | None = None, progress=None) -> ModelWeights:
    """Read every weight, one tensor at a time.

    ``transform(role, name, load, shape, layer) -> stored object`` decides what is kept (e.g. a quantized
    tensor, see ``toolkit.quant``); the default loads f32, and keeps a weight stored quantized (MXFP4 experts,
    whose loader has ``qtensor()``) as stored.
    """
    transform = transform or (lambda role, name, load, shape, layer=None: load.qtensor() if hasattr(load, "qtensor") else load())
    V, D = cfg.vocab_size, cfg.hidden_size
    check_layers(ck, cfg)
    emb_name = "model.embed_tokens.weight"
    head_name = emb_name if cfg.tie_word_embeddings or "lm_head.weight" not in ck else "lm_head.weight"
    if head_name != "lm_head.weight" and not cfg.tie_word_embeddings:
        raise ModelError(f"{ck.missing('lm_head.weight')} (and tie_word_embeddings is false)")
    emb_load = _table(ck, emb_name, (V, D))
    embed = transform("embed", emb_name, emb_load, (V, D))
    if head_name != emb_name:
        head_load = _table(ck, head_name, (V, D))
    else:  # tied: the head is what the transform kept of the table (loaded again for one that keeps nothing)
        head_load = emb_load if embed is None else (lambda: embed)
    mw = ModelWeights(embed=embed, norm=shape_at(ck, "model.norm.weight", ck.get_f32("model.norm.weight"), (D,)),
                      lm_head=transform("lm_head", head_name, head_load, (V, D)))
    for i in range(cfg.num_layers):
        fields: dict = {"attn": {}, "moe": {} if cfg.moe_layers[i] else None, "mlp": None if cfg.moe_layers[i] else {}}
        for role, name, load, shape in iter_layer_tensors(ck, cfg, i):
            a = transform(role, name, _checked(name, load, shape, ck), shape, i)
            group, _, key = role.partition(".")
            if key:
                fields[group][key] = a
            else:
                fields[group] = a
        mw.layers.append(LayerWeights(**fields))
        if progress is not None:
            progress.update(1)
    return mw
