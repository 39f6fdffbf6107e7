"""The declared schema of every ``config.json`` key the runtime reads: type, range, and relations.

A key is read through :class:`Keys`, which checks it as it reads it, so a bad value stops the load before
anything is allocated, with a message naming the file, the key, what was expected and what was found:
``config.json: 'num_hidden_layers' must be an integer in [1, 1024], got 1000000000``.

Ranges are generous bounds on real models (DeepSeek-V3: 61 layers, 256 experts, vocab 129k; the largest
public vocabularies are about 260k); they exist to refuse absurd values early, not to second-guess
real ones. ``bool`` is never accepted as an integer (JSON ``true`` is not ``1`` here), and no float key
accepts NaN or infinity.
"""
from __future__ import annotations

import math

from ..errors import ModelError

REQUIRED = object()

LIMITS = {  # key: (lo, hi) for integer keys; shared by every family
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "num_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "intermediate_size": (0, 1 << 20),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (0, 1 << 24),
    "decoder_sparse_step": (1, 1024),
    "max_window_layers": (0, 1 << 20),
    "original_max_position_embeddings": (1, 1 << 24),
}


def _type_name(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


class Keys:
    """Typed, range-checked access to one JSON object (a config, or a nested object of it)."""

    def __init__(self, raw: dict, source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    def _fail(self, key: str, expected: str, value) -> ModelError:
        shown = repr(value) if not isinstance(value, (dict, list)) else _type_name(value)
        return ModelError(f"{self.source}: '{self.prefix}{key}' must be {expected}, got {shown}")

    def _value(self, key: str, default):
        v = self.raw.get(key)
        if v is None:
            if default is REQUIRED:
                raise ModelError(f"{self.source}: missing key '{self.prefix}{key}'")
            return default, True
        return v, False

    def int(self, key: str, default=REQUIRED, lo: int | None = None, hi: int | None = None, limit: str | None = None) -> int:
        v, defaulted = self._value(key, default)
        if defaulted:
            return v
        if lo is None and hi is None:
            lo, hi = LIMITS[limit or key]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._fail(key, f"an integer in [{lo}, {hi}]", v)
        return v

    def float(self, key: str, default=REQUIRED, lo: float = -math.inf, hi: float = math.inf,
              lo_open: bool = False) -> float:
        v, defaulted = self._value(key, default)
        if defaulted:
            return v
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        ok = ok and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            left = "(" if lo_open else "["
            raise self._fail(key, f"a finite number in {left}{lo:g}, {hi:g}]", v)
        return float(v)

    def bool(self, key: str, default=REQUIRED) -> bool:
        v, defaulted = self._value(key, default)
        if not defaulted and not isinstance(v, bool):
            raise self._fail(key, "true or false", v)
        return v

    def str(self, key: str, default=REQUIRED, choices: tuple | None = None) -> str:
        v, defaulted = self._value(key, default)
        if defaulted:
            return v
        if not isinstance(v, str) or (choices and v not in choices):
            raise self._fail(key, f"one of {', '.join(choices)}" if choices else "a string", v)
        return v

    def int_list(self, key: str, lo: int, hi: int, default=()) -> tuple[int, ...]:
        v, defaulted = self._value(key, default)
        if defaulted:
            return tuple(v)
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi for x in v):
            raise self._fail(key, f"a list of integers in [{lo}, {hi}]", v)
        return tuple(v)

    def str_list(self, key: str, choices: tuple, default=()) -> tuple[str, ...]:
        v, defaulted = self._value(key, default)
        if defaulted:
            return tuple(v)
        if not isinstance(v, list) or any(x not in choices for x in v):
            raise self._fail(key, f"a list of {', '.join(choices)}", v)
        return tuple(v)

    def ids(self, key: str, vocab: int, single: bool = False) -> tuple[int, ...]:
        """A token id or a list of them (``eos_token_id``), each in [0, vocab); one id only with ``single``."""
        v, defaulted = self._value(key, ())
        if defaulted:
            return ()
        items = [v] if single or not isinstance(v, list) else v
        if any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab for x in items):
            raise self._fail(key, f"a token id in [0, {vocab})" if single else
                             f"a token id (or a list of them) in [0, {vocab})", v)
        return tuple(items)

    def obj(self, key: str) -> "Keys":
        v, defaulted = self._value(key, {})
        if not defaulted and not isinstance(v, dict):
            raise self._fail(key, "an object", v)
        return Keys(v, self.source, f"{self.prefix}{key}.")


def relation(ok: bool, source: str, message: str) -> None:
    """A declared relation between keys (``1 <= top_k <= num_experts``, ``hidden % heads == 0``)."""
    if not ok:
        raise ModelError(f"{source}: {message}")


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_settings(keys: Keys, max_pos: int) -> tuple[float, str, dict]:
    """``rope_theta`` and the scaling parameters, from ``rope_parameters`` (transformers 5) or the legacy
    ``rope_theta`` / ``rope_scaling`` keys, each checked for the rope type that uses it."""
    raw = keys.raw
    params = keys.obj("rope_parameters")
    legacy = keys.obj("rope_scaling")
    merged_raw = {**legacy.raw, **params.raw}
    merged = Keys(merged_raw, keys.source, "rope_parameters." if params.raw else "rope_scaling.")
    theta = merged.float("rope_theta", None, lo=0, hi=1e12, lo_open=True)
    if theta is None:
        theta = keys.float("rope_theta", 10000.0, lo=0, hi=1e12, lo_open=True)
    rope_type = merged_raw.get("rope_type", merged_raw.get("type")) or "default"
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES or rope_type == "dynamic":
        raise ModelError(f"{keys.source}: rope type {rope_type!r} is not supported (default, linear, llama3, yarn)")
    if rope_type != "default":
        merged.float("factor", lo=0, hi=1e6, lo_open=True)
    if rope_type == "llama3":
        lo = merged.float("low_freq_factor", lo=0, hi=1e6, lo_open=True)
        hi = merged.float("high_freq_factor", lo=0, hi=1e6, lo_open=True)
        relation(hi > lo, keys.source, f"rope high_freq_factor ({hi}) must exceed low_freq_factor ({lo})")
        merged.int("original_max_position_embeddings")
    if rope_type == "yarn":
        merged.int("original_max_position_embeddings", None)
        for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            merged.float(k, None, lo=0, hi=1e6)
        merged.bool("truncate", None)
    del raw
    return theta, rope_type, merged_raw
