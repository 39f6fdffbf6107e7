"""A lazy, memory-mapped safetensors reader (and an atomic writer) with validation.

Reading maps the file once and hands out zero-copy NumPy views, so a checkpoint is never held twice.
Every malformed file gets a ModelError naming the file (and the tensor): a header longer than the file,
offsets outside the data section or overlapping, a byte length that does not match dtype and shape.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import ModelError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafeTensorsFile:
    """Tensors of one .safetensors file as read-only memory-mapped arrays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ModelError(f"{self.path}: truncated (no safetensors header)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER or 8 + n > size:
                    raise ModelError(f"{self.path}: header length {n} exceeds the file ({size} bytes)")
                header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{self.path}: safetensors header is not valid JSON ({e})") from None
        except OSError as e:
            raise ModelError(f"{self.path}: cannot read ({e})") from None
        if not isinstance(header, dict):
            raise ModelError(f"{self.path}: safetensors header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple, int, int]] = {}
        spans = []
        for name, info in header.items():
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(s) for s in info["shape"])
                lo, hi = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ModelError(f"{self.path}: tensor {name!r} has a malformed header entry {info!r}") from None
            if any(s < 0 for s in shape) or not (0 <= lo <= hi <= data_len):
                raise ModelError(f"{self.path}: tensor {name!r} offsets [{lo}, {hi}) lie outside the data ({data_len} bytes)")
            if hi - lo != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ModelError(f"{self.path}: tensor {name!r} has {hi - lo} bytes, but {info['dtype']}{list(shape)} needs "
                                 f"{int(np.prod(shape, dtype=np.int64)) * dtype.itemsize}")
            self._entries[name] = (dtype, shape, lo, hi)
            spans.append((lo, hi, name))
        spans.sort()
        for (a_lo, a_hi, a), (b_lo, b_hi, b) in zip(spans, spans[1:]):
            if b_lo < a_hi and b_hi > b_lo:
                raise ModelError(f"{self.path}: tensors {a!r} and {b!r} overlap in the data section")
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for a in arrays:
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
