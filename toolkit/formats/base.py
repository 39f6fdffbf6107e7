"""The format record and the quantized tensor.

Shape legend: ``N`` output features (rows), ``K`` input features (the reduced dim), ``G = K / g``
groups per row, ``B = K / 32`` GGML blocks per row. Weights are ``[..., N, K]``; leading dims (stacked
experts ``[E, N, K]``) are carried through every array of a quantized tensor.

A format is data: one :class:`Format` record holds everything the rest of the toolkit needs
(bits, group size, array layout, NumPy reference codec, Numba codec). Code outside
``toolkit/formats`` looks behaviour up in the record; it never branches on a format's name.
"""
from __future__ import annotations

import dataclasses
from collections import abc
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..backend import resolve_backend
from ..errors import BackendError, FormatError

# quantize(w [..., N, K] f32, fmt) -> {array name: ndarray};  dequantize(arrays, fmt, shape) -> f32 [..., N, K]
QuantizeFn = Callable[[np.ndarray, "Format"], dict]
DequantizeFn = Callable[[Mapping[str, np.ndarray], "Format", tuple], np.ndarray]


@dataclass(frozen=True)
class Codec:
    quantize: QuantizeFn
    dequantize: DequantizeFn


@dataclass(frozen=True)
class ArraySpec:
    """One stored array of a quantized tensor: its dtype and shape for a given logical shape."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Format:
    """One quantization (or plain) format.

    ``group_size``: values sharing one scale along K (``None``: one scale per output row, as int8/fp8;
    ``1`` for the unquantized formats). ``layout(shape)`` names every stored array with dtype and
    shape; bytes and bits per weight derive from it, so they cannot disagree with the data.
    """

    name: str
    kind: str  # "dense" | "channel" | "affine" | "block" | "mx" | "ggml": a description, never a switch
    bits: int  # bits of one stored weight code
    group_size: int | None
    doc: str
    layout: Callable[["Format", tuple], dict[str, ArraySpec]]
    codecs: Mapping[str, Codec] = field(repr=False)
    group_sizes: tuple[int, ...] = ()  # group sizes a user may choose (empty: fixed)
    act_quant: Mapping[str, Callable] | None = field(default=None, repr=False)  # per-token activation codec
    quantized: bool = True
    max_abs: float | None = None  # largest magnitude the format can hold (f16 scales/values: 65504)
    # the stored scales of ``arrays`` as float arrays (None: every float-typed array), checked for NaN / inf
    # when a tensor is read from a file
    scales: Callable[[Mapping[str, np.ndarray]], list] | None = field(default=None, repr=False)
    # ---- the format in every other layer: each table of the toolkit is built from these fields ----------
    block: tuple[int, int] | None = None  # (values, bytes) of one stored block along K (GGML block formats)
    cpu_decoder: str | None = None  # its decoder in the Numba GEMM kernels (toolkit/cpu/decoders.py)
    cuda_decoder: str | None = None  # its decoder struct in cuda_src/formats.cuh (moe_gemm.cu)
    kv_row: str | None = None  # its KV cache row struct in cuda_src/formats.cuh; set: a KV cache type
    uqff_tag: int | None = None  # the UQFF family storing it (toolkit/uqff/spec.py TAG_*); None: residual only
    ggml_type: int | None = None  # GGML's type id (GGUF, and UQFF's Gguf family)
    int_form: str | None = None  # its exact integer form for the integer GEMMs (toolkit/formats/int_form.py FORMS)
    offered: bool = True  # in the app's choices and the default warm-up (False: GGML's own, read from GGUF / on request)

    # ---- derived facts -------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The user-facing name including a non-default group size, e.g. ``int4-g128``."""
        return f"{self.name}-g{self.group_size}" if self.group_sizes else self.name

    def arrays(self, shape: tuple[int, ...]) -> dict[str, ArraySpec]:
        self.check_shape(shape)
        return self.layout(self, tuple(int(s) for s in shape))

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return sum(a.nbytes for a in self.arrays(shape).values())

    def bits_per_weight(self, shape: tuple[int, ...] = (4096, 4096)) -> float:
        """Stored bits per weight, scales and offsets included."""
        return 8.0 * self.nbytes(shape) / float(np.prod(shape))

    def with_group_size(self, group_size: int | None) -> "Format":
        if group_size is None or group_size == self.group_size:
            return self
        if group_size not in self.group_sizes:
            allowed = ", ".join(map(str, self.group_sizes)) or "none (fixed)"
            raise FormatError(f"format {self.name!r} does not take group size {group_size}; allowed: {allowed}")
        return dataclasses.replace(self, group_size=group_size)

    def check_shape(self, shape: tuple[int, ...], name: str = "weight") -> None:
        if len(shape) < 1:
            raise FormatError(f"tensor {name!r}: format {self.name!r} needs at least one dimension, got shape {shape}")
        k = shape[-1]
        g = self.group_size or 1
        if k % g:
            fits = [h for h in self.group_sizes if k % h == 0]
            hint = (f"; use {', '.join(f'{self.name}-g{h}' for h in sorted(fits, reverse=True))}" if fits else
                    f"; no group size of {self.name} ({', '.join(map(str, self.group_sizes))}) divides it" if self.group_sizes else "")
            raise FormatError(
                f"tensor {name!r}: inner dimension {k} of shape {tuple(shape)} is not divisible by the "
                f"group size {g} of format {self.spec!r}{hint}"
            )

    def codec(self, backend: str) -> Codec:
        b = resolve_backend(backend)
        if b not in self.codecs:
            raise BackendError(f"format {self.name!r} has no {b!r} codec; it has {', '.join(self.codecs)}")
        return self.codecs[b]

    # ---- the operations ----------------------------------------------------------------------------
    def act_dequant(self, x: np.ndarray, backend: str) -> np.ndarray:
        """``x [R, K]`` f32 -> the values a W8A8 kernel of this format multiplies: each row quantized with
        ``act_quant`` and decoded (``x`` itself for weight-only formats)."""
        if self.act_quant is None:
            return x
        parts = self.act_quant[backend](x)  # (codes [R, K], scales [R]) in the order of the layout
        return self.codec(backend).dequantize(dict(zip(self.arrays(x.shape), parts)), self, x.shape)

    def quantize(self, w: np.ndarray, backend: str = "numpy", name: str = "weight") -> "QTensor":
        """Quantize ``w [..., N, K]`` into this format; raises FormatError naming ``name`` on bad input."""
        w = np.asarray(w)
        self.check_shape(w.shape, name)
        check_finite(w, name)
        w32 = readonly(np.ascontiguousarray(w, dtype=np.float32))
        if self.max_abs is not None and w32.size and float(np.abs(w32).max()) > self.max_abs:
            raise FormatError(f"tensor {name!r}: values up to {float(np.abs(w32).max()):.4g} exceed the range of "
                              f"format {self.spec!r} (|w| <= {self.max_abs:g})")
        try:
            arrays = self.codec(backend).quantize(w32, self)
        except FormatError as e:
            raise FormatError(f"tensor {name!r}: {e}") from None
        qt = QTensor(self, tuple(w.shape), arrays)
        qt.validate(name)
        return qt


@dataclass
class QTensor:
    """A tensor stored in a format: ``arrays`` laid out as ``fmt.arrays(shape)`` says."""

    fmt: Format
    shape: tuple[int, ...]  # logical [..., N, K]
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        n = getattr(self.arrays, "nbytes", None)  # arrays derived when read (JoinedArrays, a packed layout's)
        return int(n) if n is not None else sum(int(a.nbytes) for a in self.arrays.values())

    def pieces(self, rows: int):
        """(expert, first row, QTensor of at most ``rows`` rows of that expert) covering the tensor, each a view of
        the stored arrays (a joined tensor's: of one part's), never a concatenation. A 2-D tensor is expert 0."""
        parts = self.arrays.parts if isinstance(self.arrays, JoinedArrays) else [self]
        parts = [p if isinstance(p.arrays, dict) else QTensor(p.fmt, p.shape, dict(p.arrays.items()))
                 for p in parts]  # arrays derived when read (a join of joins, a packed layout's): built once
        E = self.shape[0] if len(self.shape) == 3 else 1
        for e in range(E):
            off = 0
            for p in parts:
                n = p.shape[-2]
                for r0 in range(0, n, rows):
                    r1 = min(n, r0 + rows)
                    sub = {k: v[e, r0:r1] if len(self.shape) == 3 else v[r0:r1] for k, v in p.arrays.items()}
                    yield e, off + r0, QTensor(self.fmt, (r1 - r0, self.shape[-1]), sub)
                off += n

    def stored(self) -> list[np.ndarray]:
        """The arrays that hold the stored bytes: a joined tensor's parts' arrays, not a concatenation (for
        ``toolkit.mapped.release``)."""
        a = self.arrays
        if isinstance(a, JoinedArrays):
            return [v for p in a.parts for v in p.stored()]
        return list(a.values()) if isinstance(a, dict) else []  # derived from a packed layout: nothing stored

    def dequantize(self, backend: str = "numpy") -> np.ndarray:
        """f32 [..., N, K]: for tests, oracles and benchmarks (kernels decode inline instead)."""
        return self.fmt.codec(backend).dequantize(self.arrays, self.fmt, self.shape)

    def validate(self, name: str = "weight") -> None:
        """Check that every array has the dtype and shape the format's layout prescribes."""
        want = self.fmt.arrays(self.shape)
        if set(want) != set(self.arrays):
            raise FormatError(
                f"tensor {name!r} in format {self.fmt.spec!r}: arrays {sorted(self.arrays)} != expected {sorted(want)}"
            )
        for key, spec in want.items():
            a = self.arrays[key]
            if np.dtype(a.dtype) != np.dtype(spec.dtype) or tuple(a.shape) != spec.shape:
                raise FormatError(
                    f"tensor {name!r} in format {self.fmt.spec!r}: array {key!r} is {a.dtype}{list(a.shape)}, "
                    f"expected {np.dtype(spec.dtype)}{list(spec.shape)}"
                )

    def check_scales(self, name: str = "weight") -> None:
        """Refuse NaN / inf in the stored scales (a damaged file); names the tensor, the array and the index.
        Plain arrays sharing a leading axis are read ``CHECK_BYTES`` at a time, and the pages of a mapped file a
        piece read are handed back after it (``toolkit/mapped.py``): a GGML block's scale sits in every block, so
        checking a bundle's experts before they were packed made the whole file resident at once."""
        from ..mapped import file_ranges, release

        arrays = self.arrays
        plain = isinstance(arrays, dict) and all(isinstance(a, np.ndarray) and a.ndim for a in arrays.values())
        rows = {a.shape[0] for a in arrays.values()} if plain else set()
        n = rows.pop() if len(rows) == 1 else 0
        total = sum(a.nbytes for a in arrays.values()) if n else 0
        step = max(1, n * CHECK_BYTES // max(total, 1)) if n else 1
        ranges = file_ranges() if total > CHECK_BYTES else None
        found: dict = {}  # scale array index -> [bad count, first bad index]
        seen: dict = {}  # scale array index -> its length along axis 0 in the pieces before
        for i in range(0, max(n, 1), step):
            piece = {k: a[i:i + step] for k, a in arrays.items()} if n else arrays
            if self.fmt.scales is not None:
                named = [("scales", a) for a in self.fmt.scales(piece)]
            else:
                named = [(k, a) for k, a in piece.items() if np.dtype(a.dtype).kind == "f"]
            for j, (key, a) in enumerate(named):
                bad = ~np.isfinite(np.asarray(a, np.float32))
                if bad.any():
                    first = tuple(int(x) for x in np.argwhere(bad)[0])
                    f = found.setdefault(j, [key, 0, (first[0] + seen.get(j, 0),) + first[1:]])
                    f[1] += int(bad.sum())
                seen[j] = seen.get(j, 0) + (a.shape[0] if a.ndim else 1)
            if ranges:
                release(list(piece.values()), ranges)
        if found:
            key, count, idx = found[min(found)]
            raise FormatError(f"tensor {name!r} in format {self.fmt.spec!r}: {key} hold {count} NaN or "
                              f"inf value(s), the first at index {idx}")


CHECK_BYTES = 64 << 20  # bytes of a tensor's arrays per step of QTensor.check_scales


class JoinedArrays(abc.Mapping):
    """The arrays of QTensors joined along their rows (``gate`` then ``up``), concatenated when read and not
    kept: the parts stay as they are (views of a mapped file, say), so a joined weight costs no copy until
    something reads it whole (the CPU kernels pack it piece by piece instead: ``QTensor.pieces``)."""

    def __init__(self, parts: list, axis: int):
        self.parts, self.axis = list(parts), axis

    def __getitem__(self, key: str) -> np.ndarray:
        return np.concatenate([p.arrays[key] for p in self.parts], axis=self.axis)

    def __iter__(self):
        return iter(self.parts[0].arrays)

    def __len__(self) -> int:
        return len(self.parts[0].arrays)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy). Kernels receive weights this way whether they came from a
    memory-mapped file (read-only) or were computed (writable): Numba compiles one specialization per
    array flavour, so one flavour means one compile, and ``moqe warmup`` covers what real models use."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def array_module(a):
    """NumPy, or CuPy for a CuPy array: the block layouts are taken apart with the same code on the host and on a
    GPU (toolkit/gpu/mma_pack.py repacks experts where they were uploaded)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def check_finite(w: np.ndarray, name: str) -> None:
    """Raise FormatError naming the tensor and the first bad index when w holds NaN or inf."""
    if w.dtype.kind not in "fc" and w.dtype.name not in ("bfloat16",):
        if w.dtype.kind in "iub":
            return
    w32 = np.asarray(w, dtype=np.float32)
    bad = ~np.isfinite(w32)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        what = "NaN" if np.isnan(w32[idx]) else "inf"
        raise FormatError(f"tensor {name!r}: contains {what} at index {idx} ({int(bad.sum())} non-finite values); refusing to quantize")
