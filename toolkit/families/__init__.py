"""Model families as files built from parts (``parts/``): one small module per family names its parts and its
own rules, and this registry finds them. Nothing outside this package compares a family's name; a family that
only recombines parts is its own file and nothing else.

``FAMILIES``: config.json architecture name -> :class:`Family`; ``gguf_families(name)``: those llama.cpp names so.
"""
from __future__ import annotations

import importlib
import pkgutil

from .family import Family


def _discover() -> dict[str, Family]:
    found = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name in ("parts", "family"):
            continue
        fam = importlib.import_module(f"{__name__}.{mod.name}").FAMILY
        found[fam.name] = fam
    return found


FAMILIES = _discover()


def gguf_families(name: str) -> list[Family]:
    return [f for f in FAMILIES.values() if f.gguf is not None and f.gguf == name]


GGUF_NAMES = tuple(dict.fromkeys(f.gguf for f in FAMILIES.values() if f.gguf))
