"""The registry of formats: one record per format, looked up by name (``int4``, ``int4-g128``, ``q8_0``...).

Adding a format is one module defining its :class:`~toolkit.formats.base.Format` record(s) and one line
in ``_MODULES`` below; nothing else in the toolkit branches on format names.
"""
from __future__ import annotations

import re

from ..errors import FormatError
from . import affine, dense, fp8, ggml, int8, kquant
from .base import ArraySpec, Codec, Format, QTensor, check_finite

_MODULES = (dense, int8, fp8, affine, ggml, kquant)
FORMATS: dict[str, Format] = {}
for _m in _MODULES:
    for _f in _m.FORMATS:
        if _f.name in FORMATS:
            raise RuntimeError(f"format {_f.name!r} registered twice")
        FORMATS[_f.name] = _f

_SPEC = re.compile(r"^(?P<name>[a-z0-9_]+?)(?:-g(?P<g>\d+))?$")


def get_format(spec: str | Format, group_size: int | None = None) -> Format:
    """``int4`` (default group), ``int4-g128`` or ``get_format('int4', 128)``; raises FormatError when unknown."""
    if isinstance(spec, Format):
        return spec.with_group_size(group_size)
    m = _SPEC.match(str(spec).strip().lower())
    fmt = FORMATS.get(m.group("name")) if m else None
    if fmt is None:
        raise FormatError(f"unknown format {spec!r}; known: {', '.join(FORMATS)} (group-wise ones take -g32/-g64/-g128)")
    if m.group("g") is not None:
        if group_size is not None and int(m.group("g")) != group_size:
            raise FormatError(f"format {spec!r} names group size {m.group('g')} but {group_size} was also given")
        group_size = int(m.group("g"))
    return fmt.with_group_size(group_size)


def describe_specs(names=None) -> str:
    """The format names a flag takes, for its help: ``names`` (default every quantized format) in registry order,
    a group-wise one marked ``[-gN]`` with the group sizes it takes (the help text is made from the registry,
    so it lists what the parser accepts)."""
    names = [f.name for f in FORMATS.values() if f.quantized] if names is None else list(names)
    sizes = sorted({g for n in names for g in FORMATS[n].group_sizes})
    listed = ", ".join(n + ("[-gN]" if FORMATS[n].group_sizes else "") for n in names)
    return listed + (f" (-gN: group size {', '.join(map(str, sizes))})" if sizes else "")


__all__ = ["ArraySpec", "Codec", "FORMATS", "Format", "QTensor", "check_finite", "describe_specs", "get_format"]
