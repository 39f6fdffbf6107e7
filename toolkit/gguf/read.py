"""A GGUF model file (llama.cpp's format) as a model: ``load_gguf(path)`` -> (MoEModel, Tokenizer).

Reads llama-architecture files with experts (Mixtral as llama.cpp's converter writes it, ``names.py``), memory-
mapped by the ``gguf`` package: hyperparameters from ``llama.*``, tensors by their ``blk.N.*`` names (q/k rows
put back from GGML's rope pairs), the tokenizer from ``tokenizer.ggml.*``. Tensors stored in a GGML type our
registry holds (q8_0, q4_0, mxfp4, f16, bf16) stay as stored unless a policy names another format; f32 ones
are read as they are. Anything else (another architecture, a k-quant, a missing or mis-shaped tensor) is a
``ModelError`` naming the file and the key or tensor.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..formats import QTensor
from .names import ARCH, GGML_FORMATS, GLOBAL, LAYER, rope_rows

MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def field(reader, key: str, where: str, default=None):
    """A scalar field's value (int, float, bool or str), or ``default`` when absent (None: required)."""
    from .tokenizer import field_value

    v = field_value(reader, key, where)
    if v is None:
        if default is None:
            raise ModelError(f"{where}: GGUF key {key!r} is missing")
        return default
    if isinstance(v, list):
        raise ModelError(f"{where}: GGUF key {key!r} is an array, expected one value")
    return v


def _config(reader, where: str):
    """llama.* hyperparameters -> our ModelConfig (as config.json would give them)."""
    from ..model.config import config_from_dict

    arch = field(reader, "general.architecture", where)
    if arch != ARCH:
        raise ModelError(f"{where}: GGUF architecture {arch!r} is not supported; supported: {ARCH} (Mixtral)")
    def a(k, d=None):
        v = field(reader, f"{ARCH}.{k}", where, d)
        # f32 fields back to the decimal they were written from (1e-05, not 9.99999974e-06)
        return float(str(np.float32(v))) if isinstance(v, float) else v

    n_exp = a("expert_count", 0)
    if not n_exp:
        raise ModelError(f"{where}: {ARCH}.expert_count is missing or 0: a dense llama model, not an MoE")
    heads = a("attention.head_count")
    hidden = a("embedding_length")
    if a("rope.scaling.type", "none") not in ("none",):
        raise ModelError(f"{where}: {ARCH}.rope.scaling.type {a('rope.scaling.type')!r} is not supported")
    raw = {"architectures": ["MixtralForCausalLM"], "hidden_size": hidden, "num_hidden_layers": a("block_count"),
           "num_attention_heads": heads, "num_key_value_heads": a("attention.head_count_kv", heads),
           "head_dim": a("attention.key_length", hidden // heads), "intermediate_size": a("feed_forward_length"),
           "num_local_experts": n_exp, "num_experts_per_tok": a("expert_used_count"),
           "max_position_embeddings": a("context_length", 4096), "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
           "rope_theta": a("rope.freq_base", 10000.0),
           "tie_word_embeddings": GLOBAL["lm_head"] not in {t.name for t in reader.tensors},
           "torch_dtype": _dtype(reader)}
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        v = field(reader, name, where, -1)
        if v >= 0:
            raw[key] = v
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    raw["vocab_size"] = a("vocab_size", len(tokens.data) if tokens is not None else 0)
    return config_from_dict(raw, where)


def _dtype(reader) -> str:
    """The checkpoint dtype the file's 2-D weights say (f16 / bf16 / f32): what the model keeps its head in."""
    kinds = [GGML_FORMATS.get(int(t.tensor_type)) for t in reader.tensors if len(t.shape) >= 2]
    names = {f.name for f in kinds if f is not None}
    return "float16" if "f16" in names else "bfloat16" if "bf16" in names else "float32"


class _Tensors:
    """GGUF tensors by name: loaders of our shapes, with ``qtensor()`` for a GGML type of our registry."""

    def __init__(self, reader, where: str):
        self.where = where
        self.t = {t.name: t for t in reader.tensors}

    def _get(self, name: str, shape: tuple):
        t = self.t.get(name)
        if t is None:
            raise ModelError(f"{self.where}: GGUF tensor {name!r} is missing")
        got = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if got != tuple(shape):
            raise ModelError(f"{self.where}: GGUF tensor {name!r} has shape {list(got)}, the metadata implies {list(shape)}")
        fmt = GGML_FORMATS.get(int(t.tensor_type))
        if fmt is None:
            raise ModelError(f"{self.where}: GGUF tensor {name!r} is of GGML type {t.tensor_type.name}, which is not "
                             f"supported (supported: {', '.join(sorted(f.name for f in GGML_FORMATS.values()))})")
        return t, fmt

    def qtensor(self, name: str, shape: tuple, dense: bool = False) -> QTensor | None:
        """The tensor as stored (a QTensor view) when its type is a quantized format (or with ``dense``, a 16-bit
        one too); else None: f16 / bf16 weights load as f32, as a checkpoint's do."""
        t, fmt = self._get(name, shape)
        if fmt.kind == "dense" and (not dense or fmt.name == "f32"):
            return None
        (key, spec), = fmt.arrays(shape).items()
        data = np.asarray(t.data)
        if data.nbytes != np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape)):
            raise ModelError(f"{self.where}: GGUF tensor {name!r} holds {data.nbytes} bytes, {fmt.name}{list(shape)} "
                             f"needs {np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape))}")
        qt = QTensor(fmt, tuple(shape), {key: data.view(spec.dtype).reshape(spec.shape)})
        qt.check_scales(name)
        return qt

    def f32(self, name: str, shape: tuple) -> np.ndarray:
        t, _ = self._get(name, shape)
        qt = self.qtensor(name, shape, dense=True)
        a = np.asarray(t.data, np.float32).reshape(shape) if qt is None else qt.dequantize("numpy")
        if not np.isfinite(a).all():
            raise ModelError(f"{self.where}: GGUF tensor {name!r} holds NaN or inf")
        return a

    def loader(self, name: str, shape: tuple, rows=None, stored: bool = True):
        """load() -> f32 ``shape``; with ``stored``, load.qtensor() -> the stored QTensor (or None); ``rows(w)``
        applied to both."""
        fix = rows or (lambda w: w)

        def load():
            return fix(self.f32(name, shape))

        if not stored:  # embeddings, LM head, router: read as f32 (the model keeps them in its own precision)
            return load

        def qtensor():
            qt = self.qtensor(name, shape)
            return fix(qt) if qt is not None else None

        load.qtensor = qtensor
        return load


def _experts(ts: _Tensors, gate: str, up: str, shape: tuple):
    """gate and up ``[E, I, D]`` -> our ``gate_up [E, 2I, D]``: f32, or the two stored QTensors joined."""
    from ..uqff.keys import join_rows

    def load():
        return np.concatenate([ts.f32(gate, shape), ts.f32(up, shape)], axis=1)

    def qtensor():
        g, u = ts.qtensor(gate, shape), ts.qtensor(up, shape)
        if g is None or u is None or g.fmt != u.fmt:
            return None
        return join_rows([g, u])

    load.qtensor = qtensor
    return load


def gguf_info(path) -> tuple:
    """(ModelConfig, rows per GGML type: tensors, parameters, bytes) of a GGUF file, no weights read."""
    from .export import _gguf

    where = str(path)
    try:
        reader = _gguf().GGUFReader(path)
    except Exception as e:  # noqa: BLE001 (the package raises plain errors on damaged files)
        raise ModelError(f"{where}: not a readable GGUF file ({str(e)[:200]})") from None
    cfg = _config(reader, where)
    rows: dict[str, dict] = {}
    for t in reader.tensors:
        r = rows.setdefault(t.tensor_type.name, {"GGML type": t.tensor_type.name, "tensors": 0, "parameters": 0, "bytes": 0})
        r["tensors"] += 1
        r["parameters"] += int(t.n_elements)
        r["bytes"] += int(t.n_bytes)
    return cfg, sorted(rows.values(), key=lambda r: -r["bytes"])


def load_gguf(path, backend: str = "numba", policy=None, kv_cache=None, report=None):
    """(MoEModel, Tokenizer) of a GGUF file; ``policy`` requantizes what it names (None: as stored)."""
    from ..model import MoEModel, Runtime
    from ..model.kv_cache import parse_kv_cache
    from ..model.tokenizer import Tokenizer
    from ..model.weights import LayerWeights, ModelWeights
    from ..quant import Policy, quantizing_transform
    from .export import _gguf
    from .tokenizer import tokenizer_from_gguf

    gguf = _gguf()
    where = str(path)
    parse_kv_cache(kv_cache)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the package raises plain errors on damaged files
        raise ModelError(f"{where}: not a readable GGUF file ({str(e)[:200]})") from None
    cfg = _config(reader, where)
    if policy is not None:
        policy, _ = policy.fit(cfg)
    ts = _Tensors(reader, where)
    transform = Runtime(backend).placing(quantizing_transform(policy or Policy(), backend, report))
    V, D, L, E, I = cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.expert_intermediate
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def keep(role, name, shape, layer=None, rows=None, load=None, stored=True):
        return transform(role, name, load or ts.loader(name, shape, rows, stored), shape, layer)

    embed = keep("embed", GLOBAL["embed"], (V, D), stored=False)
    head = embed if cfg.tie_word_embeddings else keep("lm_head", GLOBAL["lm_head"], (V, D), stored=False)
    mw = ModelWeights(embed=embed, norm=ts.f32(GLOBAL["norm"], (D,)), lm_head=head)
    for i in range(L):
        n = {role: t.format(i=i) for role, t in LAYER.items()}
        attn = {"q": keep("attn.q", n["attn.q"], (H * hd, D), i, lambda w: rope_rows(w, H, inverse=True)),
                "k": keep("attn.k", n["attn.k"], (Hkv * hd, D), i, lambda w: rope_rows(w, Hkv, inverse=True)),
                "v": keep("attn.v", n["attn.v"], (Hkv * hd, D), i),
                "o": keep("attn.o", n["attn.o"], (D, H * hd), i)}
        moe = {"router": keep("moe.router", n["moe.router"], (E, D), i, stored=False),
               "gate_up": keep("moe.gate_up", f"{n['moe.gate']}+{n['moe.up']}", (E, 2 * I, D), i,
                               load=_experts(ts, n["moe.gate"], n["moe.up"], (E, I, D))),
               "down": keep("moe.down", n["moe.down"], (E, D, I), i)}
        mw.layers.append(LayerWeights(attn_norm=ts.f32(n["attn_norm"], (D,)), ffn_norm=ts.f32(n["ffn_norm"], (D,)),
                                      attn=attn, moe=moe))
    hf_tok, meta = tokenizer_from_gguf(reader)
    tok = Tokenizer.from_tokenizer(hf_tok, meta.get("bos_token_id"), cfg.eos_token_ids, bool(meta.get("add_bos")))
    return MoEModel(cfg, mw, backend, kv_cache=kv_cache), tok
