"""UQFF families: a QTensor <-> the safetensors entries of one layer, one encoder/decoder pair per family.

Looked up in :data:`FAMILIES` by tag (reading) or through ``spec.FAMILY_OF_FORMAT`` (writing); nothing
branches on format names. Shapes: ``[..., N, K]`` logical (``[E, N, K]`` for stacked experts).
Decoders check every entry's dtype and shape and raise :class:`~toolkit.uqff.spec.UQFFError` naming the
file and the tensor; the arrays they return are zero-copy views into the memory-mapped shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from ..errors import FormatError
from ..formats import FORMATS, QTensor, get_format
from . import spec
from .spec import UQFFError

GGML_TYPE_ID = {f.name: f.ggml_type for f in FORMATS.values() if f.uqff_tag == 0}  # block formats: GGML's type ids
GGML_FORMAT = {v: k for k, v in GGML_TYPE_ID.items()}  # GGML type id -> registry format name
AFFINE_BITS = (2, 3, 4)
FLOAT_KINDS = "f"


class Entries:
    """The entries of one layer ``key`` as the reader sees them: ``get(suffix, dtype, ndim)`` checks."""

    def __init__(self, key: str, lookup: Callable[[str], tuple[np.ndarray, str]]):
        self.key, self._lookup = key, lookup

    def get(self, suffix: str, dtype=None, ndim: int | None = None) -> np.ndarray:
        name = self.key + suffix
        a, where = self._lookup(name)
        if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
            raise UQFFError(f"{where}: tensor {name!r} is {a.dtype}, expected {np.dtype(dtype)}")
        if ndim is not None and a.ndim != ndim:
            raise UQFFError(f"{where}: tensor {name!r} has shape {list(a.shape)}, expected {ndim} dimension(s)")
        return np.asarray(a)

    def fail(self, suffix: str, msg: str):
        name = self.key + suffix
        _, where = self._lookup(name)
        raise UQFFError(f"{where}: tensor {name!r}: {msg}")

    def scalar(self, suffix: str, dtype) -> int:
        return int(self.get(suffix, dtype, 0))


def _qtensor(ent: Entries, fmt, shape: tuple, arrays: dict) -> QTensor:
    qt = QTensor(fmt, tuple(int(s) for s in shape), arrays)
    try:
        qt.validate(ent.key)
    except FormatError as e:
        ent.fail(".weight", f"does not match format {fmt.spec!r} ({e})")
    try:
        qt.check_scales(ent.key)
    except FormatError as e:
        ent.fail(".weight", str(e))
    return qt


# ---- Gguf (tag 0): U8 1-D raw blocks, GGML type id, logical shape --------------------------------------------
def gguf_encode(qt: QTensor) -> dict:
    return {".weight": np.ascontiguousarray(qt.arrays["blocks"]).reshape(-1),
            ".weight.dtype": np.array(GGML_TYPE_ID[qt.fmt.name], np.uint32),
            ".weight.shape": np.array(qt.shape, np.uint32)}


def gguf_decode(ent: Entries):
    """A QTensor of the registry's GGML format (q8_0, q4_0, mxfp4, the k-quants, q4_1, q5_0, q5_1; mistral.rs
    stores embeddings and the LM head as q6_K)."""
    type_id = ent.scalar(".weight.dtype", np.uint32)
    if type_id not in GGML_FORMAT:
        ent.fail(".weight.dtype", f"GGML type {type_id} is not supported (supported: "
                 f"{', '.join(f'{v}={k}' for k, v in GGML_TYPE_ID.items())})")
    fmt = get_format(GGML_FORMAT[type_id])
    shape = tuple(int(s) for s in ent.get(".weight.shape", np.uint32, 1))
    blocks = ent.get(".weight", np.uint8, 1)
    if not shape or any(s <= 0 for s in shape) or shape[-1] % fmt.group_size:
        ent.fail(".weight.shape", f"logical shape {list(shape)} is not valid for {fmt.name}")
    want = fmt.arrays(shape)["blocks"]
    if blocks.nbytes != want.nbytes:
        ent.fail(".weight", f"holds {blocks.nbytes} bytes, but {fmt.name}{list(shape)} needs {want.nbytes}")
    return _qtensor(ent, fmt, shape, {"blocks": blocks.reshape(want.shape)})


# ---- MoqeAffine (tag 100): Afq-shaped entries, our packing ------------------------------------------------
def affine_encode(qt: QTensor) -> dict:
    q = np.ascontiguousarray(qt.arrays["qweight"])  # [..., N, K*b/8] u8, a little-endian bit stream
    if q.shape[-1] % 4:
        raise UQFFError(f"packed row of {q.shape[-1]} bytes is not a whole number of U32 words")
    return {".weight": q.view("<u4"),  # [..., N, K*b/32]
            ".weight.bits": np.array(qt.fmt.bits, np.uint8),
            ".weight.group_size": np.array(qt.fmt.group_size, np.uint8),
            ".weight.scales": qt.arrays["scales"], ".weight.biases": qt.arrays["biases"]}


def affine_decode(ent: Entries) -> QTensor:
    bits, group = ent.scalar(".weight.bits", np.uint8), ent.scalar(".weight.group_size", np.uint8)
    if bits not in AFFINE_BITS:
        ent.fail(".weight.bits", f"{bits} bits is not one of {AFFINE_BITS}")
    try:
        fmt = get_format(f"int{bits}", group)
    except FormatError as e:
        ent.fail(".weight.group_size", str(e))
    w = ent.get(".weight", np.uint32)
    if w.ndim < 2:
        ent.fail(".weight", f"has shape {list(w.shape)}, expected [..., N, K*bits/32]")
    shape = w.shape[:-1] + (w.shape[-1] * 32 // bits,)
    if (w.shape[-1] * 32) % bits or shape[-1] % group:
        ent.fail(".weight", f"{w.shape[-1]} words per row do not hold whole groups of {group} {bits}-bit codes")
    arrays = {"qweight": w.view(np.uint8), "scales": ent.get(".weight.scales", np.float16),
              "biases": ent.get(".weight.biases", np.float16)}
    return _qtensor(ent, fmt, shape, arrays)


# ---- MoqeInt8 (101) / MoqeFp8 (102): per-channel codes + f32 scales ---------------------------------------
def channel_encode(stored_dtype):
    def encode(qt: QTensor) -> dict:
        return {".weight": np.ascontiguousarray(qt.arrays["qweight"]).view(stored_dtype),
                ".weight.scales": qt.arrays["scales"]}

    return encode


def channel_decode(fmt_name: str, stored_dtype):
    def decode(ent: Entries) -> QTensor:
        fmt = get_format(fmt_name)
        w = ent.get(".weight", stored_dtype)
        if w.ndim < 2:
            ent.fail(".weight", f"has shape {list(w.shape)}, expected [..., N, K]")
        want = fmt.arrays(w.shape)["qweight"].dtype
        return _qtensor(ent, fmt, w.shape, {"qweight": w.view(want), "scales": ent.get(".weight.scales", np.float32)})

    return decode


# ---- Unquant (1): read only (this toolkit writes full-precision tensors to residual.safetensors) --------
def unquant_decode(ent: Entries) -> np.ndarray:
    w = ent.get(".weight")
    if w.dtype.kind not in FLOAT_KINDS and w.dtype != np.dtype(ml_dtypes.bfloat16):
        ent.fail(".weight", f"dtype {w.dtype} is not a float type")
    return np.asarray(w, dtype=np.float32)


@dataclass(frozen=True)
class Family:
    tag: int
    name: str
    encode: Callable[[QTensor], dict] | None  # None: read-only family
    decode: Callable[[Entries], object]
    suffixes: tuple[str, ...]  # entries besides ".weight.format"


FAMILIES = {f.tag: f for f in (
    Family(spec.TAG_GGUF, "Gguf", gguf_encode, gguf_decode, (".weight", ".weight.dtype", ".weight.shape")),
    Family(spec.TAG_UNQUANT, "Unquant", None, unquant_decode, (".weight",)),
    Family(spec.TAG_MOQE_AFFINE, "MoqeAffine", affine_encode, affine_decode,
           (".weight", ".weight.bits", ".weight.group_size", ".weight.scales", ".weight.biases")),
    Family(spec.TAG_MOQE_INT8, "MoqeInt8", channel_encode(np.int8), channel_decode("int8", np.int8),
           (".weight", ".weight.scales")),
    Family(spec.TAG_MOQE_FP8, "MoqeFp8", channel_encode(ml_dtypes.float8_e4m3fn),
           channel_decode("fp8", ml_dtypes.float8_e4m3fn), (".weight", ".weight.scales")),
)}


def encode(qt: QTensor) -> tuple[int, dict]:
    """(tag, {suffix: array}) for one quantized layer, the format tag entry included."""
    tag = spec.FAMILY_OF_FORMAT.get(qt.fmt.name)
    if tag is None:
        raise UQFFError(f"format {qt.fmt.spec!r} has no UQFF family")
    entries = FAMILIES[tag].encode(qt)
    entries[spec.FORMAT_SUFFIX] = np.array(tag, np.uint8)
    return tag, entries
