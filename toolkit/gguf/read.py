"""A GGUF model file (llama.cpp's format) as a model: ``load_gguf(path)`` -> (MoEModel, Tokenizer).

Reads the MoE families of ``toolkit/families`` that name a GGUF architecture (llama with experts = Mixtral,
qwen2moe, qwen3moe, olmoe, gpt-oss, deepseek2 = DeepSeek-V2/V3, glm4moe = GLM-4.5) as llama.cpp's converter
writes them, memory-mapped by the ``gguf`` package: hyperparameters from ``{arch}.*``,
tensors by their ``blk.N.*`` names (llama's q/k rows put back from GGML's rope pairs), the tokenizer from
``tokenizer.ggml.*``. Tensors stored in a GGML type our
registry holds (q8_0, q4_0, mxfp4, the k-quants q2_K..q6_K, q4_1, q5_0, q5_1, f16, bf16) stay as stored unless a
policy names another format; f32 ones are read as they are. Anything else (another architecture, an i-quant, a
missing or mis-shaped tensor) is a ``ModelError`` naming the file and the key or tensor.

Before any tensor's data is used, the file's layout is checked as the safetensors reader checks its own
(``_check_layout``): every tensor's GGML type known, its dims 1 to 4 and each at least 1, its rows a whole number of
the type's blocks, its offset aligned to ``general.alignment``, its bytes (exactly what type and shape imply,
counted in Python ints) inside the file's data section, and no two tensors' bytes overlapping. Every metadata
number the config is built from is checked (``toolkit.numbers``: whole numbers in range, reals finite) and so is
each relation a later division needs, before any arithmetic is done with it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError, ModelError
from ..formats import QTensor
from ..mapped import release
from ..numbers import real, whole
from ..families import GGUF_NAMES, gguf_families
from ..families.parts.router import GATING
from .names import GGML_FORMATS, GLOBAL, YARN_TRUNCATE

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS


def is_gguf(path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def _shape(dims) -> list:
    """GGUF dims (innermost first) in our order, as the other messages name shapes."""
    return list(reversed(dims))


def _check_layout(where: str, fields, data_start: int, alignment: int, size: int) -> None:
    """Every tensor-table entry checked before any data is mapped: a complete entry, 1 to MAX_DIMS dims each at
    least 1, a known GGML type whose blocks divide its rows, an offset aligned to ``alignment``, its bytes (what type
    and shape imply, in Python ints: no overflow) inside the data section ``[data_start, size)``, no name twice, and
    no two tensors' bytes overlapping. ``fields``: the gguf package's tensor-info fields, ``parts`` = [name length,
    name, dim count, dims, type, offset]."""
    from .export import _gguf

    gguf = _gguf()
    spans, seen = [], set()
    for i, f in enumerate(fields):
        parts, name = f.parts, f.name
        cut = ModelError(f"{where}: the tensor table is cut short at entry {i} (the file ends inside its header)")
        if len(parts) != 6 or len(parts[0]) != 1 or len(parts[1]) != int(parts[0][0]) or len(parts[2]) != 1:
            raise cut
        n_dims = int(parts[2][0])
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelError(f"{where}: tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        if len(parts[3]) != n_dims or len(parts[4]) != 1 or len(parts[5]) != 1:
            raise cut
        if name in seen:
            raise ModelError(f"{where}: tensor {name!r} is listed twice in the tensor table")
        seen.add(name)
        dims = [int(d) for d in parts[3]]
        if any(d < 1 for d in dims):
            raise ModelError(f"{where}: tensor {name!r} has shape {_shape(dims)}: every dimension must be at least 1")
        raw = int(parts[4][0])
        try:
            gtype = gguf.GGMLQuantizationType(raw)
            block, type_size = gguf.GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise ModelError(f"{where}: tensor {name!r} has GGML type id {raw}, which is not a GGML type") from None
        what = f"tensor {name!r} of type {gtype.name} and shape {_shape(dims)}"
        if dims[0] % block:
            raise ModelError(f"{where}: {what}: its rows of {dims[0]} values are not a whole number of the type's "
                             f"{block}-value blocks")
        need = math.prod(dims) // block * type_size  # Python ints: no overflow
        rel = int(parts[5][0])
        start = data_start + rel
        if rel % alignment:
            raise ModelError(f"{where}: tensor {name!r} has data offset {rel} (byte {start}), not a multiple of the "
                             f"file's alignment of {alignment} bytes (general.alignment)")
        if start + need > size:
            raise ModelError(f"{where}: {what} needs {need} bytes from byte {start}, but the file holds "
                             f"{max(0, size - start)} bytes from there (it ends at byte {size})")
        spans.append((start, start + need, i, name, what, need))
    spans.sort()
    prev = None
    for span in spans:
        start, end, _, name, _, _ = span
        if prev is not None and start < prev[1]:
            p_start, p_end, _, p_name, p_what, p_need = prev
            if p_start < start:  # the earlier tensor runs into this one (a wider type, or this one moved into it)
                raise ModelError(f"{where}: {p_what} needs {p_need} bytes (bytes {p_start}..{p_end}), but tensor "
                                 f"{name!r} begins at byte {start}: the two overlap")
            raise ModelError(f"{where}: tensor {name!r} (bytes {start}..{end}) overlaps tensor {p_name!r} "
                             f"(bytes {p_start}..{p_end})")
        if prev is None or end > prev[1]:
            prev = span


@functools.cache
def _reader_class():
    """gguf.GGUFReader with the layout checked (``_check_layout``) before it maps any tensor's data: its
    ``_build_tensors`` gets the tensor-info fields once the header is read, before it makes any tensor's view."""
    from .export import _gguf

    class Reader(_gguf().GGUFReader):
        def __init__(self, path, where: str):
            self.where, self.checked = where, False
            super().__init__(path)

        def _build_tensors(self, start_offs, fields):
            _check_layout(self.where, fields, int(start_offs), int(self.alignment), len(self.data))
            self.checked = True
            super()._build_tensors(start_offs, fields)

    return Reader


def open_gguf(path, where: str | None = None):
    """The gguf package's reader over ``path``, its tensor layout checked; a ``ModelError`` naming the file (and
    the tensor) for a damaged one."""
    where = where or str(path)
    try:
        reader = _reader_class()(path, where)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 (the package raises plain errors on damaged files)
        raise ModelError(f"{where}: not a readable GGUF file ({str(e)[:200]})") from None
    if not reader.checked:  # a gguf package without the hook: the same checks on what it has read
        _check_layout(where, [t.field for t in reader.tensors], int(reader.data_offset), int(reader.alignment),
                      len(reader.data))
    return reader


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


def _whole(v, what: str, lo: int, hi: int) -> int:
    """A GGUF metadata value that must be a whole number in ``[lo, hi]`` (an integer type: no bool, float or
    string), else a ModelError naming ``what`` (the file and the key)."""
    if isinstance(v, str):
        raise ModelError(f"{what} must be a whole number, got the string {v[:40]!r}")
    return whole(v, what, lo, hi, error=ModelError)


def _real(v, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """A GGUF metadata value that must be a finite number in the range (no bool or string)."""
    if isinstance(v, str):
        raise ModelError(f"{what} must be a number, got the string {v[:40]!r}")
    return real(v, what, lo, hi, lo_open=lo_open, error=ModelError)


class _Meta:
    """A GGUF file's ``{arch}.*`` metadata as the family's parts read it: ``a(k)`` a value, ``n(k, lo, hi)`` a whole
    number, ``x(k, lo, hi)`` a finite real (``d``: the default when absent; None: required), each error naming the
    file and the key; ``tensors``: the tensor table by name."""

    def __init__(self, reader, where: str, name: str):
        self.reader, self.where, self.name = reader, where, name
        self.tensors = {t.name: t for t in reader.tensors}
        self.n_exp, self.expert_size_key = 0, ""

    def key(self, k: str) -> str:
        return f"{self.name}.{k}"

    def has(self, k: str) -> bool:
        return self.key(k) in self.reader.fields

    def a(self, k, d=None):
        v = field(self.reader, self.key(k), self.where, d)
        # f32 fields back to the decimal they were written from (1e-05, not 9.99999974e-06)
        return float(str(np.float32(v))) if isinstance(v, float) and math.isfinite(v) and abs(v) < 3e38 else v

    def n(self, k, lo, hi, d=None) -> int:
        return _whole(self.a(k, d), f"{self.where}: {self.key(k)}", lo, hi)

    def x(self, k, lo, hi, d=None, lo_open=False) -> float:
        return _real(self.a(k, d), f"{self.where}: {self.key(k)}", lo, hi, lo_open)


def _family(reader, where: str):
    """The family a GGUF file holds: by ``general.architecture``; families sharing that name (deepseek2: DeepSeek-V2
    and V3) by their router's gating function (``{arch}.expert_gating_func``, softmax when absent)."""
    name = field(reader, "general.architecture", where)
    fams = gguf_families(name) if isinstance(name, str) else []
    if not fams:
        raise ModelError(f"{where}: GGUF architecture {name!r} is not supported; supported: {', '.join(GGUF_NAMES)} "
                         f"(with experts)")
    m = _Meta(reader, where, name)
    if len(fams) == 1:
        return fams[0], m
    func = m.n("expert_gating_func", 0, (1 << 32) - 1, 1)
    fam = next((f for f in fams if GATING[getattr(f.router, "gating", "softmax")] == func), None)
    if fam is None:
        raise ModelError(f"{where}: {m.key('expert_gating_func')} {func} is not supported "
                         f"({', '.join(getattr(f.router, 'gating', 'softmax') for f in fams)})")
    return fam, m


def _config(reader, where: str):
    """{arch}.* hyperparameters -> our ModelConfig (as the family's config.json would give them): the generic keys
    here, each part's own keys by the part (``toolkit/families/parts``). Every number is checked (range, type,
    finiteness) and every relation a division below or in the model needs, before use."""
    from ..model.config import config_from_dict
    from ..model.schema import LIMITS, relation

    fam, m = _family(reader, where)
    a, n, x, key = m.a, m.n, m.x, m.key
    if not a("expert_count", 0):
        raise ModelError(f"{where}: {m.name}.expert_count is missing or 0: a dense model, not an MoE")
    n_exp = m.n_exp = n("expert_count", *LIMITS["num_experts"])
    m.expert_size_key = fam.experts.size_key
    scaling = a("rope.scaling.type", "none")
    if scaling not in ("none", "yarn"):
        raise ModelError(f"{where}: {m.name}.rope.scaling.type {scaling!r} is not supported (none, yarn)")
    heads = n("attention.head_count", *LIMITS["num_attention_heads"])
    hidden = n("embedding_length", *LIMITS["hidden_size"])
    layers = n("block_count", *LIMITS["num_hidden_layers"])
    kv_heads = n("attention.head_count_kv", *LIMITS["num_key_value_heads"], heads)
    relation(heads % kv_heads == 0, where, f"{key('attention.head_count')} ({heads}) must be a multiple of "
             f"{key('attention.head_count_kv')} ({kv_heads})")
    if m.has("attention.key_length"):
        head_dim = n("attention.key_length", *LIMITS["head_dim"])
    else:  # llama.cpp's default: hidden / heads (MLA files always give it, and MLA does not use it)
        if fam.attention.head_dim_from_hidden:
            relation(hidden % heads == 0, where, f"{key('embedding_length')} ({hidden}) must be a multiple of "
                     f"{key('attention.head_count')} ({heads}) when {key('attention.key_length')} is not given")
        head_dim = _whole(hidden // heads, f"{where}: the head dim ({key('embedding_length')} / "
                          f"{key('attention.head_count')})", *LIMITS["head_dim"])
    top_k = n("expert_used_count", *LIMITS["num_experts_per_tok"])
    relation(top_k <= n_exp, where, f"{key('expert_used_count')} ({top_k}) must be at most "
             f"{key('expert_count')} ({n_exp})")
    tensors = m.tensors
    emb = tensors.get(GLOBAL["embed"])
    if emb is not None:
        if len(emb.shape) != 2:
            raise ModelError(f"{where}: GGUF tensor {GLOBAL['embed']!r} has {len(emb.shape)} dimensions, expected 2")
        vocab = _whole(int(emb.shape[1]), f"{where}: the vocabulary (rows of GGUF tensor {GLOBAL['embed']!r})",
                       *LIMITS["vocab_size"])
    elif m.has("vocab_size"):
        vocab = n("vocab_size", *LIMITS["vocab_size"])
    else:
        raise ModelError(f"{where}: GGUF tensor {GLOBAL['embed']!r} is missing")
    raw = {"architectures": [fam.name], "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "num_experts_per_tok": top_k,
           "max_position_embeddings": n("context_length", *LIMITS["max_position_embeddings"], 4096),
           "rms_norm_eps": x("attention.layer_norm_rms_epsilon", 0, 1, lo_open=True),
           "rope_theta": x("rope.freq_base", 0, 1e12, 10000.0, lo_open=True),
           "tie_word_embeddings": GLOBAL["lm_head"] not in tensors, "torch_dtype": _dtype(reader),
           "vocab_size": vocab}
    if scaling == "yarn":  # llama.cpp's yarn: the correction range rounded unless our key says otherwise
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": x("rope.scaling.factor", 0, 1e6, lo_open=True),
                               "original_max_position_embeddings": n("rope.scaling.original_context_length",
                                                                     *LIMITS["original_max_position_embeddings"]),
                               "truncate": bool(a(YARN_TRUNCATE, True))}
        for k in ("beta_fast", "beta_slow"):
            v = a(f"rope.scaling.yarn_{k}", -1.0)
            if v != -1.0:
                raw["rope_scaling"][k] = x(f"rope.scaling.yarn_{k}", 0, 1e6)
    for part in fam.parts:
        part.gguf_config(m, raw)
    if fam.gguf_rule is not None:
        fam.gguf_rule(m, raw)
    for k, fname in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        v = _whole(field(reader, fname, where, -1), f"{where}: {fname}", -(1 << 63), (1 << 64) - 1)
        if 0 <= v < vocab:
            raw[k] = v
    return config_from_dict(raw, where), fam


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
            what = ", ".join(sorted(f.name for f in GGML_FORMATS.values()))
            raise ModelError(f"{self.where}: GGUF tensor {name!r} is of GGML type {t.tensor_type.name}, which is not "
                             f"supported (supported: {what})")
        return t, fmt

    def qtensor(self, name: str, shape: tuple, dense: bool = False) -> QTensor | None:
        """The tensor as stored (a QTensor view) when its type is a quantized format (or with ``dense``, a 16-bit
        one too); else None: f16 / bf16 weights load as f32, as a checkpoint's do."""
        t, fmt = self._get(name, shape)
        if fmt is None or not fmt.quantized and (not dense or fmt.name == "f32"):
            return None  # f32
        try:
            (key, spec), = fmt.arrays(shape).items()
        except FormatError as e:  # a row length the type's blocks do not divide
            raise ModelError(f"{self.where}: GGUF tensor {name!r}: {e}") from None
        data = np.asarray(t.data)
        if data.nbytes != np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape)):
            raise ModelError(f"{self.where}: GGUF tensor {name!r} holds {data.nbytes} bytes, {fmt.name}{list(shape)} "
                             f"needs {np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape))}")
        qt = QTensor(fmt, tuple(shape), {key: data.view(spec.dtype).reshape(spec.shape)})
        qt.check_scales(name)
        return qt

    def table16(self, name: str, shape: tuple) -> QTensor | None:
        """The tensor as stored when it is f16 / bf16 (a view of the mapped file); else None."""
        qt = self.qtensor(name, shape, dense=True)
        return qt if qt is not None and not qt.fmt.quantized else None

    def f32(self, name: str, shape: tuple) -> np.ndarray:
        t, fmt = self._get(name, shape)
        qt = self.qtensor(name, shape, dense=True)
        a = np.asarray(t.data, np.float32).reshape(shape) if qt is None else qt.dequantize("numpy")
        if not np.may_share_memory(a, t.data):  # a converted copy is kept: the mapped pages are handed back
            release([np.asarray(t.data)])
        if not np.isfinite(a).all():
            raise ModelError(f"{self.where}: GGUF tensor {name!r} holds NaN or inf")
        return a

    def f32_any(self, name: str, shape: tuple) -> np.ndarray:
        """``f32`` for a tensor that a converter may have stored with its unit dims dropped ([1, D] as [D])."""
        t = self.t.get(name)
        if t is not None and int(np.prod(t.shape.tolist())) == int(np.prod(shape)) and len(t.shape) != len(shape):
            return self.f32(name, tuple(int(x) for x in reversed(t.shape.tolist()))).reshape(shape)
        return self.f32(name, shape)

    def loader(self, name: str, shape: tuple, rows=None, stored: bool = True):
        """load() -> f32 ``shape``; with ``stored``, load.qtensor() -> the stored QTensor (or None); ``rows(w)``
        applied to both."""
        fix = rows or (lambda w: w)

        def load():
            w = self.f32(name, shape)
            out = fix(w)
            if out is not w and not np.may_share_memory(out, w):  # rows reordered (a copy): the source handed back
                release([w])
            return out

        def table16():  # offered as stored when 16-bit (the runtime may keep it so: Runtime.placing)
            qt = self.table16(name, shape)
            return fix(qt) if qt is not None else None

        load.table16 = table16
        if not stored:  # embeddings, LM head, router: read as f32 (or as stored, 16-bit)
            return load

        def qtensor():
            qt = self.qtensor(name, shape)
            return fix(qt) if qt is not None else None

        load.qtensor = qtensor
        return load


def _experts(ts: _Tensors, gate: str, up: str, shape: tuple):
    """gate and up ``[(E,) I, D]`` -> our ``gate_up [(E,) 2I, D]``: f32, or the two stored QTensors joined."""
    from ..uqff.keys import join_rows

    def load():
        return np.concatenate([ts.f32(gate, shape), ts.f32(up, shape)], axis=-2)

    def qtensor():
        g, u = ts.qtensor(gate, shape), ts.qtensor(up, shape)
        if g is None or u is None or g.fmt != u.fmt:
            return None
        return join_rows([g, u])

    load.qtensor = qtensor
    return load


@dataclass(frozen=True)
class _Layer:
    """One GGUF layer as the parts read it: ``n`` role -> tensor name, ``keep(role, name, shape, layer, ...)`` the
    load's transform, ``join(gate, up, shape)`` gate and up as one ``gate_up`` loader."""

    ts: _Tensors
    cfg: object
    n: dict
    keep: object
    i: int

    def join(self, gate: str, up: str, shape: tuple):
        return _experts(self.ts, gate, up, shape)


def gguf_info(path) -> tuple:
    """(ModelConfig, rows per GGML type: tensors, parameters, bytes) of a GGUF file, no weights read."""
    where = str(path)
    reader = open_gguf(path, where)
    cfg, _ = _config(reader, where)
    rows: dict[str, dict] = {}
    for t in reader.tensors:
        r = rows.setdefault(t.tensor_type.name, {"GGML type": t.tensor_type.name, "tensors": 0, "parameters": 0, "bytes": 0})
        r["tensors"] += 1
        r["parameters"] += int(t.n_elements)
        r["bytes"] += int(t.n_bytes)
    return cfg, sorted(rows.values(), key=lambda r: -r["bytes"])


def gguf_resident(path) -> int:
    """Expected resident bytes of a GGUF file loaded as stored on the CPU (Numba backend): a quantized tensor
    as the kernels pack it, a 16-bit embedding / head as stored, other 16-bit tensors widened to f32, f32 as is."""
    from ..model.inspect import packed_bytes

    reader, total = open_gguf(path, str(path)), 0
    keep16 = {GLOBAL["embed"], GLOBAL["lm_head"]}
    for t in reader.tensors:
        fmt = GGML_FORMATS.get(int(t.tensor_type))
        shape = [int(x) for x in reversed(t.shape.tolist())]
        if fmt is None or not fmt.quantized:
            wide = fmt is not None and fmt.name in ("f16", "bf16") and t.name not in keep16
            total += int(t.n_bytes) * (2 if wide else 1)
        else:
            total += packed_bytes(fmt, int(np.prod(shape[:-1])), shape[-1], mapped=True)
    return total


def load_gguf(path, backend: str = "numba", policy=None, kv_cache=None, report=None, activations=None,
              placement=None, shard=None, experts=None):
    """(MoEModel, Tokenizer) of a GGUF file; ``policy`` requantizes what it names (None: as stored); ``placement``
    (a PlacementSpec): where the routed experts live; ``shard`` / ``experts``: an expert-parallel driver's share
    and its remote experts (``toolkit/dist``)."""
    from ..model import MoEModel
    from ..model.kv_cache import parse_kv_cache
    from ..model.tokenizer import Tokenizer
    from .tokenizer import tokenizer_from_gguf

    parse_kv_cache(kv_cache)
    cfg, mw, places, reader = gguf_weights(path, backend, policy, report, activations, placement, shard)
    hf_tok, meta = tokenizer_from_gguf(reader)
    tok = Tokenizer.from_tokenizer(hf_tok, meta.get("bos_token_id"), cfg.eos_token_ids, bool(meta.get("add_bos")))
    return MoEModel(cfg, mw, backend, experts=experts, kv_cache=kv_cache, activations=activations, places=places), tok


def gguf_weights(path, backend: str = "numba", policy=None, report=None, activations=None, placement=None, shard=None):
    """A GGUF file's (ModelConfig, ModelWeights, Places, reader); ``shard`` (an ExpertShard): read only its share."""
    from ..model import Runtime
    from ..model.placement import resolve_places
    from ..model.weights import LayerWeights, ModelWeights
    from ..quant import Policy, quantizing_transform

    where = str(path)
    reader = open_gguf(path, where)
    cfg, _ = _config(reader, where)
    if policy is not None:
        policy, _ = policy.fit(cfg)
    ts = _Tensors(reader, where)
    places = resolve_places(placement, cfg, backend)  # refused before any weight is read
    transform = Runtime(backend, activations, places).placing(quantizing_transform(policy or Policy(), backend, report), cfg, shard)
    V, D, L = cfg.vocab_size, cfg.hidden_size, cfg.num_layers

    def keep(role, name, shape, layer=None, rows=None, load=None, stored=True):
        return transform(role, name, load or ts.loader(name, shape, rows, stored), shape, layer)

    embed = keep("embed", GLOBAL["embed"], (V, D), stored=False)
    head = embed if cfg.tie_word_embeddings else keep("lm_head", GLOBAL["lm_head"], (V, D), stored=False)
    mw = ModelWeights(embed=embed, norm=ts.f32(GLOBAL["norm"], (D,)), lm_head=head)
    fam = cfg.family
    for i in range(L):
        n = fam.layer_names(i)
        g = _Layer(ts, cfg, n, keep, i)
        attn = fam.attention.gguf_tensors(g)
        moe = mlp = None
        if cfg.moe_layers[i]:
            moe = {**fam.router.gguf_tensors(g), **fam.experts.gguf_tensors(g)}
        else:  # a dense MLP layer (DeepSeek's leading ones)
            Id = cfg.dense_intermediate
            mlp = {"gate_up": keep("mlp.gate_up", f"{n['mlp.gate']}+{n['mlp.up']}", (2 * Id, D), i,
                                   load=_experts(ts, n["mlp.gate"], n["mlp.up"], (Id, D))),
                   "down": keep("mlp.down", n["mlp.down"], (D, Id), i)}
        if moe is not None and shard is not None:  # the expert biases are read directly: cut to the shard's
            moe.update({k: shard.select(moe[k], i) if shard.keeps(f"moe.{k}", i) else None
                        for k in ("gate_up_bias", "down_bias") if k in moe})
        mw.layers.append(LayerWeights(attn_norm=ts.f32(n["attn_norm"], (D,)), ffn_norm=ts.f32(n["ffn_norm"], (D,)),
                                      attn=attn, moe=moe, mlp=mlp))
    return cfg, mw, places, reader
