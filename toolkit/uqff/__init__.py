"""UQFF bundles: save a quantized model once, load it memory-mapped without requantizing.

The layout is specified in ``toolkit/uqff/SPEC.md``; its constants live in :mod:`toolkit.uqff.spec`.
"""
from .inspect import inspect_bundle
from .reader import Bundle, is_bundle, load_bundle
from .spec import VERSION, UQFFError
from .writer import save_bundle

__all__ = ["Bundle", "UQFFError", "VERSION", "inspect_bundle", "is_bundle", "load_bundle", "save_bundle"]
