"""Module attributes loaded on first use (PEP 562), for the backends' facades (``toolkit/cpu/api.py``,
``toolkit/gpu/api.py``): importing a facade imports none of the modules behind it."""
from __future__ import annotations

import importlib


def lazy_getattr(module_globals: dict, where: dict):
    """A module ``__getattr__`` serving ``where`` (name -> (submodule of the module's package, its name there)).
    Each use reads the name from its module (an import already done is a dictionary lookup), so the facade never
    holds a stale copy: what the module has now (a value set at run time, a test's patch) is what callers get."""
    package, name_of = module_globals["__package__"], module_globals["__name__"]

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {name_of!r} has no attribute {name!r}")
        module, attr = where[name]
        return getattr(importlib.import_module(f"{package}.{module}"), attr)

    return __getattr__
