"""A lazy, memory-mapped safetensors reader (and an atomic writer) with validation.

Reading maps the file once and hands out zero-copy NumPy views, so a checkpoint is never held twice.
Every malformed file gets a ModelError naming the file (and the tensor): a header longer than the file,
offsets outside the data section or overlapping, a byte length that does not match dtype and shape.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import ModelError
from ..files import check_regular, parse_json
from ..writes import atomic_write

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024
MAX_HEADER_DEPTH = 4  # {name: {"shape": [...]}}: a header nests three levels; deeper is refused before parsing
MAX_RANK = 8


def _entry(path: Path, name: str, info) -> tuple[np.dtype, tuple, int, int]:
    """One header entry -> (dtype, shape, lo, hi), every field checked (types exact: no bool, no float)."""
    def bad(why: str) -> ModelError:
        return ModelError(f"{path}: tensor {name!r} has a malformed header entry ({why}): {str(info)[:200]}")

    if not isinstance(info, dict):
        raise bad("not an object")
    if "dtype" not in info:
        raise bad("no dtype")
    if not isinstance(info["dtype"], str) or info["dtype"] not in DTYPES:
        raise bad(f"unknown dtype {info['dtype']!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise bad(f"shape must be a list of at most {MAX_RANK} dimensions")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise bad("shape entries must be non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets):
        raise bad("data_offsets must be two integers")
    return np.dtype(DTYPES[info["dtype"]]), tuple(shape), offsets[0], offsets[1]


class SafeTensorsFile:
    """Tensors of one .safetensors file as read-only memory-mapped arrays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = check_regular(self.path, "safetensors file").st_size
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ModelError(f"{self.path}: truncated (no safetensors header)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER or 8 + n > size:
                    raise ModelError(f"{self.path}: header length {n} exceeds the file ({size} bytes)"
                                     if 8 + n > size else f"{self.path}: header length {n} exceeds {MAX_HEADER}")
                raw = f.read(n)
        except OSError as e:
            raise ModelError(f"{self.path}: cannot read ({e.strerror or e})") from None
        header = parse_json(raw, f"{self.path}: safetensors header", dict, MAX_HEADER_DEPTH)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise ModelError(f"{self.path}: safetensors __metadata__ is not a JSON object")
        self.metadata = meta
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple, int, int]] = {}
        spans = []
        for name, info in header.items():
            dtype, shape, lo, hi = _entry(self.path, name, info)
            if not 0 <= lo <= hi <= data_len:
                raise ModelError(f"{self.path}: tensor {name!r} offsets [{lo}, {hi}) lie outside the data ({data_len} bytes)")
            need = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
            if hi - lo != need:
                raise ModelError(f"{self.path}: tensor {name!r} has {hi - lo} bytes, but {info['dtype']}{list(shape)} needs {need}")
            self._entries[name] = (dtype, shape, lo, hi)
            if hi > lo:  # an empty tensor occupies nothing (and must not hide an overlap of its neighbours)
                spans.append((lo, hi, name))
        spans.sort()
        end, owner = 0, None
        for lo, hi, name in spans:
            if lo < end:
                raise ModelError(f"{self.path}: tensors {owner!r} and {name!r} overlap in the data section")
            if hi > end:
                end, owner = hi, name
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[np.dtype, tuple]:
        dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    def get(self, name: str) -> np.ndarray:
        """A read-only view into the mapped file (no copy)."""
        if name not in self._entries:
            raise ModelError(f"{self.path}: no tensor {name!r}")
        dtype, shape, lo, hi = self._entries[name]
        start = self._data_start + lo
        return self._mm[start : self._data_start + hi].view(dtype).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict | None = None) -> None:
    """Write a safetensors file atomically (temporary file in the same folder, fsync, rename); keys sorted."""
    path = Path(path)
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}} if metadata else {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if np.dtype(a.dtype) not in NAMES:
            raise ModelError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": NAMES[np.dtype(a.dtype)], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
