"""Numbers from anywhere: flags, JSON tables, plan files, GGUF metadata. One set of parsers, so every source
refuses the same things the same way, before any arithmetic is done with them:

- a whole number is a Python ``int`` (never ``bool``) or a string of ASCII digits (an optional ``-``), at most
  ``MAX_DIGITS`` digits (``int()`` on 5,000 digits raises, and would be slow long before), inside ``[lo, hi]``;
  ``canonical=True`` also refuses leading zeros (``00``), so one number has one spelling (plan names);
- a real number is an ``int``/``float`` (never ``bool``) or an ASCII decimal string, finite (no NaN, no
  infinities, nothing that overflows to one: ``1e400``), inside the range given, each end open or closed.

Every refusal is a :class:`~toolkit.errors.ToolkitError` (or the ``error`` class given) naming ``what``;
:func:`flag` wraps a parser as an argparse ``type=`` so a bad flag is argparse's one usage error.
"""
from __future__ import annotations

import argparse
import math
import re

from .errors import ToolkitError

MAX_DIGITS = 19  # a signed 64-bit integer has at most 19 digits
_WHOLE = re.compile(r"-?[0-9]+", re.ASCII)
_REAL = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", re.ASCII)
INT64_MAX = (1 << 63) - 1


def _shown(value) -> str:
    s = repr(value) if isinstance(value, str) else str(value)
    return s if len(s) <= 40 else s[:37] + "..."


def whole(value, what: str, lo: int = 0, hi: int = INT64_MAX, canonical: bool = False, error=ToolkitError) -> int:
    """``value`` (an int, or ASCII digits) -> int in ``[lo, hi]``; ``error`` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise error(f"{what} must be a whole number, got {_shown(value)}")
    if isinstance(value, str):
        text = value.strip()
        if not _WHOLE.fullmatch(text) or len(text.lstrip("-")) > MAX_DIGITS:
            raise error(f"{what} must be a whole number of at most {MAX_DIGITS} ASCII digits, got {_shown(value)}")
        if canonical and text.lstrip("-") != str(int(text)).lstrip("-"):
            raise error(f"{what} must be written without leading zeros, got {_shown(value)}")
        value = int(text)
    if not lo <= value <= hi:
        raise error(f"{what} must be a whole number in [{lo}, {hi}], got {_shown(value)}")
    return value


def real(value, what: str, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False,
         error=ToolkitError) -> float:
    """``value`` (an int, a float, or an ASCII decimal string) -> a finite float inside the range; ``error`` naming
    ``what`` otherwise (NaN, infinities, overflow, out of range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise error(f"{what} must be a number, got {_shown(value)}")
    if isinstance(value, str):
        if not _REAL.fullmatch(value.strip()):
            raise error(f"{what} must be a finite decimal number, got {_shown(value)}")
        value = float(value.strip())
    else:
        try:
            value = float(value)
        except OverflowError:  # an int past the float range
            raise error(f"{what} must be a finite number, got an integer of {len(str(abs(value)))} digits") from None
    if not math.isfinite(value):
        raise error(f"{what} must be a finite number, got {_shown(value)}")
    low_bad = value <= lo if lo_open else value < lo
    high_bad = value >= hi if hi_open else value > hi
    if low_bad or high_bad:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise error(f"{what} must lie in {rng}, got {value:g}")
    return value


def flag(parse, **bounds):
    """An argparse ``type=`` from :func:`whole` or :func:`real` with the given bounds: a bad value becomes
    argparse's own error line (``argument --x: ...``), rc 2."""
    def convert(text: str):
        try:
            return parse(text, "the value", **bounds)
        except ToolkitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__  # argparse names the type in some messages
    return convert
