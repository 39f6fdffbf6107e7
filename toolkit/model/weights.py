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
from .checkpoint import Checkpoint
from .config import ModelConfig


@dataclass
class LayerWeights:
    """Dense weights of one decoder layer in f32 (expert weights may be replaced by quantized tensors)."""

    attn_norm: np.ndarray  # [D]
    ffn_norm: np.ndarray  # [D]
    attn: dict  # q, k, v, o: [out, in]; q_bias, k_bias, v_bias (o_bias): [out] when the family has them;
    #              q_norm, k_norm: [hd] or [H*hd] / [Hkv*hd] for families with q/k norms;
    #              MLA: q or q_a/q_b, kv_a, kv_b, o, q_a_norm, kv_a_norm (see _mla_tensors)
    moe: dict | None = None  # router [E, D] (router_bias [E]: a logit bias; select_bias [E]: a selection bias), gate_up [E, 2I, D], down [E, D, I]; shared_* when present
    mlp: dict | None = None  # dense MLP layers: gate_up [2I, D], down [D, I]


@dataclass
class ModelWeights:
    embed: np.ndarray  # [V, D]
    norm: np.ndarray  # [D]
    lm_head: np.ndarray  # [V, D]
    layers: list[LayerWeights] = field(default_factory=list)


def _expected_shape(name: str, a: np.ndarray, shape: tuple) -> np.ndarray:
    if tuple(a.shape) != tuple(shape):
        raise ModelError(f"tensor {name!r} has shape {list(a.shape)}, the config implies {list(shape)}")
    return a


def iter_layer_tensors(ck: Checkpoint, cfg: ModelConfig, i: int) -> Iterator[tuple[str, str, Callable[[], np.ndarray], tuple]]:
    """Yield ``(role, checkpoint name, loader, shape)`` for every weight of layer ``i``.

    ``loader()`` returns f32 ``shape``; for stacked expert roles (``[E, out, in]``) ``loader(e)`` returns
    expert ``e`` alone, so a quantizer can stream expert by expert.
    """
    D, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    p = f"model.layers.{i}"
    get = ck.get_f32
    yield "attn_norm", f"{p}.input_layernorm.weight", lambda: get(f"{p}.input_layernorm.weight"), (D,)
    yield "ffn_norm", f"{p}.post_attention_layernorm.weight", lambda: get(f"{p}.post_attention_layernorm.weight"), (D,)
    if cfg.mla is not None:
        yield from _mla_tensors(get, cfg, p)
    for proj, out_dim, in_dim in () if cfg.mla else (("q", H * hd, D), ("k", Hkv * hd, D), ("v", Hkv * hd, D), ("o", D, H * hd)):
        n = f"{p}.self_attn.{proj}_proj"
        yield f"attn.{proj}", f"{n}.weight", (lambda n=n: get(f"{n}.weight")), (out_dim, in_dim)
        if cfg.qkv_bias and (proj != "o" or cfg.arch.o_bias):
            yield f"attn.{proj}_bias", f"{n}.bias", (lambda n=n: get(f"{n}.bias")), (out_dim,)
    if cfg.arch.sinks:
        yield "attn.sinks", f"{p}.self_attn.sinks", lambda: get(f"{p}.self_attn.sinks"), (H,)
    if cfg.qk_norm:  # q_norm / k_norm: over one head's hd, or over the whole projection
        for proj, heads in (("q", H), ("k", Hkv)):
            n = f"{p}.self_attn.{proj}_norm.weight"
            dim = hd if cfg.qk_norm == "head" else heads * hd
            yield f"attn.{proj}_norm", n, (lambda n=n: get(n)), (dim,)
    if not cfg.moe_layers[i]:
        n = f"{p}.mlp"
        I = cfg.dense_intermediate
        yield "mlp.gate_up", f"{n}.gate_proj+up_proj", (lambda: _cat(get, [f"{n}.gate_proj.weight", f"{n}.up_proj.weight"], (I, D))), (2 * I, D)
        yield "mlp.down", f"{n}.down_proj.weight", lambda: get(f"{n}.down_proj.weight"), (D, I)
        return
    r = cfg.arch.router_module
    prefix = next((f"{p}.{m}" for m in cfg.arch.moe_prefixes if f"{p}.{m}.{r}.weight" in ck), None)
    if prefix is None:
        raise ModelError(f"{ck.dir}: no router for layer {i} (looked for "
                         f"{', '.join(f'{p}.{m}.{r}.weight' for m in cfg.arch.moe_prefixes)})")
    E, I = cfg.num_experts, cfg.expert_intermediate
    yield "moe.router", f"{prefix}.{r}.weight", lambda: get(f"{prefix}.{r}.weight"), (E, D)
    if cfg.arch.router_logit_bias:  # added to the router's logits (gpt-oss)
        yield "moe.router_bias", f"{prefix}.{r}.bias", lambda: get(f"{prefix}.{r}.bias"), (E,)
    if cfg.arch.select_bias_name:  # a selection bias (DeepSeek-V3's e_score_correction_bias)
        rb = f"{prefix}.{r}.{cfg.arch.select_bias_name}"
        yield "moe.select_bias", rb, lambda: get(rb), (E,)
    g, u, d = cfg.arch.expert_names
    if cfg.arch.expert_layout == "gpt-oss":
        yield from _gpt_oss_experts(ck, get, f"{prefix}.experts", E, I, D)
    elif f"{prefix}.experts.gate_up_proj" in ck:  # fused layout (transformers 5 in memory)
        gu, dn = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        yield "moe.gate_up", gu, _stacked(lambda e: ck.get(gu)[e], get, gu, E, (2 * I, D)), (E, 2 * I, D)
        yield "moe.down", dn, _stacked(lambda e: ck.get(dn)[e], get, dn, E, (D, I)), (E, D, I)
    else:
        ex = f"{prefix}.experts"
        gate_up = lambda e: _cat(get, [f"{ex}.{e}.{g}.weight", f"{ex}.{e}.{u}.weight"], (I, D))  # noqa: E731
        yield "moe.gate_up", f"{ex}.*.{g}+{u}", _stacked(gate_up, None, f"{ex}.*.{g}+{u}", E, (2 * I, D)), (E, 2 * I, D)
        yield "moe.down", f"{ex}.*.{d}", _stacked(lambda e: get(f"{ex}.{e}.{d}.weight"), None, f"{ex}.*.{d}", E, (D, I)), (E, D, I)
    if cfg.shared_intermediate:
        module, gate = cfg.arch.shared_names
        s, Is = f"{prefix}.{module}", cfg.shared_intermediate
        yield "moe.shared_gate_up", f"{s}.gate_proj+up_proj", (lambda: _cat(get, [f"{s}.gate_proj.weight", f"{s}.up_proj.weight"], (Is, D))), (2 * Is, D)
        yield "moe.shared_down", f"{s}.down_proj.weight", lambda: get(f"{s}.down_proj.weight"), (D, Is)
        if gate:  # Qwen2-MoE: a sigmoid gate on the shared expert's output
            yield "moe.shared_gate", f"{prefix}.{gate}.weight", lambda: get(f"{prefix}.{gate}.weight"), (1, D)


def _gpt_oss_experts(ck, get, ex: str, E: int, I: int, D: int):
    """gpt-oss's experts -> our ``gate_up [E, 2I, D]`` (gate rows, then up rows) and ``down [E, D, I]``, plus their
    biases ``[E, 2I]`` / ``[E, D]``. The checkpoint interleaves gate and up (gate = even columns) and stores either
    f32/bf16 ``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]`` (in x out, as transformers 5 saves them) or the
    released MXFP4 ``*_blocks [E, out, in/32, 16]`` / ``*_scales [E, out, in/32]``, which stay MXFP4: the loader's
    ``qtensor()`` repacks the blocks (a byte permutation, nothing dequantized); ``load()`` decodes for a policy
    that requantizes them."""
    perm = np.concatenate([np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)])  # gate columns, then up columns
    for role, base, rows, shape in (("moe.gate_up", f"{ex}.gate_up_proj", perm, (E, 2 * I, D)),
                                    ("moe.down", f"{ex}.down_proj", None, (E, D, I))):
        if f"{base}_blocks" in ck:
            yield role, base, _mxfp4_experts(ck, base, rows, shape), shape
        else:
            yield role, base, _transposed_experts(ck, base, rows, shape), shape
    yield "moe.gate_up_bias", f"{ex}.gate_up_proj_bias", lambda: get(f"{ex}.gate_up_proj_bias")[:, perm], (E, 2 * I)
    yield "moe.down_bias", f"{ex}.down_proj_bias", lambda: get(f"{ex}.down_proj_bias"), (E, D)


def _transposed_experts(ck, base: str, rows, shape):
    """``[E, in, out]`` stored -> loader of ``[E, out, in]`` f32 (rows reordered by ``rows``), expert by expert."""
    E, N, K = shape

    def one(e):
        a = ck.get(base)
        _shape_at(ck, base, a, (E, K, N))
        w = np.asarray(a[e], np.float32).T  # [out, in]
        return np.ascontiguousarray(w[rows] if rows is not None else w)

    return _stacked(one, None, base, E, (N, K))


def _mxfp4_experts(ck, base: str, rows, shape):
    from ..formats import QTensor, get_format
    from ..formats.ggml import mxfp4_blocks_from_ocp

    E, N, K = shape
    fmt = get_format("mxfp4")

    def qtensor(e=None):
        blocks, scales = ck.get(f"{base}_blocks"), ck.get(f"{base}_scales")
        _shape_at(ck, f"{base}_blocks", blocks, (E, N, K // 32, 16))
        _shape_at(ck, f"{base}_scales", scales, (E, N, K // 32))
        if K % 32:
            raise ModelError(f"{_where(ck, base + '_blocks')}: MXFP4 needs an input width divisible by 32, got {K}")
        sel = slice(None) if e is None else slice(e, e + 1)
        b, sc = np.asarray(blocks[sel]), np.asarray(scales[sel])
        if (sc == 255).any():
            raise ModelError(f"{_where(ck, base + '_scales')}: tensor {base + '_scales'!r} holds the e8m0 NaN code 255")
        packed = mxfp4_blocks_from_ocp(b, sc)  # [E or 1, N, K/32 * 17]
        packed = np.ascontiguousarray(packed[:, rows] if rows is not None else packed)
        return QTensor(fmt, ((E,) if e is None else (1,)) + (N, K), {"blocks": packed})

    def load(e=None):  # f32, for a policy that requantizes (decoded expert by expert when e is given)
        if e is not None:
            return qtensor(e).dequantize("numpy")[0]
        return np.stack([qtensor(i).dequantize("numpy")[0] for i in range(E)])

    load.qtensor = qtensor
    return load


def _mla_tensors(get, cfg: ModelConfig, p: str):
    """Multi-head latent attention's weights (DeepSeek-V2/V3), as the checkpoint holds them:
    q (one projection, or q_a -> q_a_norm -> q_b), kv_a (latent r, then rope key dr), kv_a_norm [r],
    kv_b [H*(dn+dv), r] (per head: dn rows for the no-rope key, dv for the value), o [D, H*dv]."""
    m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
    n = f"{p}.self_attn"
    bias = cfg.qkv_bias
    rows = [("kv_a", "kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, D, bias),
            ("kv_b", "kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False),
            ("o", "o_proj", D, H * m.v_head_dim, bias and cfg.arch.o_bias)]
    if m.q_lora_rank:
        rows = [("q_a", "q_a_proj", m.q_lora_rank, D, bias), ("q_b", "q_b_proj", H * m.qk_head_dim, m.q_lora_rank, False)] + rows
    else:
        rows = [("q", "q_proj", H * m.qk_head_dim, D, False)] + rows
    for role, module, out_dim, in_dim, has_bias in rows:
        yield f"attn.{role}", f"{n}.{module}.weight", (lambda w=f"{n}.{module}.weight": get(w)), (out_dim, in_dim)
        if has_bias:
            yield f"attn.{role}_bias", f"{n}.{module}.bias", (lambda b=f"{n}.{module}.bias": get(b)), (out_dim,)
    norms = [("kv_a_norm", "kv_a_layernorm", m.kv_lora_rank)] + ([("q_a_norm", "q_a_layernorm", m.q_lora_rank)] if m.q_lora_rank else [])
    for role, module, dim in norms:
        yield f"attn.{role}", f"{n}.{module}.weight", (lambda w=f"{n}.{module}.weight": get(w)), (dim,)


def _cat(get, names: list[str], shape: tuple) -> np.ndarray:
    """Load tensors of one ``shape`` each (checked before anything is joined) and stack their rows."""
    return np.concatenate([_expected_shape(n, get(n), shape) for n in names])


def _stacked(one, get, whole_name, n, shape):
    """loader(e) -> expert e as f32; loader() -> all experts [E, out, in] (``shape`` is one expert's)."""

    def load(e=None):
        if e is not None:
            a = np.asarray(one(e), dtype=np.float32)
            if not np.isfinite(a).all():
                raise ModelError(f"expert {e} of {whole_name or 'the experts'} holds NaN or inf")
            return a
        if get is not None:
            return get(whole_name)
        return np.stack([_expected_shape(whole_name.replace("*", str(i)) + ("" if get is not None else ".weight"), one(i), shape)
                         for i in range(n)])

    return load


def _checked(name, load, shape, ck):
    """Wrap a loader so whatever it returns is checked against the shape the config implies (errors name the
    file holding the tensor)."""

    def checked(e=None):
        try:
            if e is None:
                return _expected_shape(name, load(), shape)
            return _expected_shape(name.replace("*", str(e)), load(e), shape[1:])
        except ModelError as err:
            msg = str(err)
            if msg.startswith("tensor "):  # a shape error: say where the tensor lives
                bad = msg.split("'")[1]
                raise ModelError(f"{_where(ck, bad)}: {msg}") from None
            raise

    if hasattr(load, "qtensor"):  # a weight stored quantized (MXFP4 experts): kept as stored when the policy allows
        checked.qtensor = load.qtensor
    return checked


def _shape_at(ck, name: str, a: np.ndarray, shape: tuple) -> np.ndarray:
    if tuple(a.shape) != tuple(shape):
        raise ModelError(f"{_where(ck, name)}: tensor {name!r} has shape {list(a.shape)}, the config implies {list(shape)}")
    return a


def _where(ck, name: str) -> str:
    where = getattr(ck, "where", None)
    return where(name) if where is not None else str(ck.dir)


def check_layers(ck, cfg: ModelConfig) -> None:
    """Refuse a config that declares more layers than the checkpoint holds, before anything is read."""
    held = ck.layer_count() if hasattr(ck, "layer_count") else cfg.num_layers
    if held < cfg.num_layers:
        raise ModelError(f"{ck.dir}: config.json declares {cfg.num_layers} layers (num_hidden_layers), "
                         f"the checkpoint holds {held} (model.layers.0 .. {held - 1})" if held else
                         f"{ck.dir}: config.json declares {cfg.num_layers} layers, the checkpoint holds no model.layers.* tensor")


def load_weights(ck: Checkpoint, cfg: ModelConfig, transform: Callable | None = None, progress=None) -> ModelWeights:
    """Read every weight, one tensor at a time.

    ``transform(role, name, load, shape, layer) -> stored object`` decides what is kept (e.g. a quantized
    tensor, see ``toolkit.quant``); the default loads f32, and keeps a weight stored quantized (MXFP4 experts,
    whose loader has ``qtensor()``) as stored.
    """
    transform = transform or (lambda role, name, load, shape, layer=None: load.qtensor() if hasattr(load, "qtensor") else load())
    V, D = cfg.vocab_size, cfg.hidden_size
    check_layers(ck, cfg)
    embed = _shape_at(ck, "model.embed_tokens.weight", ck.get_f32("model.embed_tokens.weight"), (V, D))
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings or "lm_head.weight" not in ck else "lm_head.weight"
    if head_name != "lm_head.weight" and not cfg.tie_word_embeddings:
        raise ModelError(f"{ck.missing('lm_head.weight')} (and tie_word_embeddings is false)")
    head = embed if head_name == "model.embed_tokens.weight" else _shape_at(ck, head_name, ck.get_f32(head_name), (V, D))
    mw = ModelWeights(embed=transform("embed", "model.embed_tokens.weight", lambda: embed, (V, D)),
                      norm=_shape_at(ck, "model.norm.weight", ck.get_f32("model.norm.weight"), (D,)),
                      lm_head=transform("lm_head", head_name, lambda: head, (V, D)))
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
