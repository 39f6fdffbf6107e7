"""One configuration of the comparison: expert format x policy x KV cache type, parsed and validated once."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.model.kv_cache import CACHE_TYPES
from toolkit.quant import Policy, parse_policy
from toolkit.warmup import FAMILIES_ALL

# the expert formats the page offers: every quantized format of the registry that has a kernel
FORMATS = ("none",) + FAMILIES_ALL  # the formats warm-up compiles (GGML's k-quants etc.: the CLI and bundles)
POLICIES = ("moqe", "all-linear")
KV_TYPES = CACHE_TYPES  # f32, q8_0, q4_0
MAX_PROMPT_CHARS = 20_000  # refused before tokenizing
MAX_NEW_TOKENS = 200


class InputError(ToolkitError, ValueError):
    """Bad input from the page; its message is shown to the user as is."""


@dataclass(frozen=True)
class Config:
    fmt: str  # one of FORMATS
    policy: str  # one of POLICIES (ignored when fmt is none)
    kv: str  # one of KV_TYPES

    @property
    def quant_policy(self) -> Policy | None:
        return None if self.fmt == "none" else parse_policy(self.policy, self.fmt)

    @property
    def label(self) -> str:
        weights = "f32 (none)" if self.fmt == "none" else f"{self.policy}:{self.fmt}"
        return f"{weights} / KV {self.kv}"


def parse_config(fmt, policy, kv) -> Config:
    """Strings from the page -> Config; InputError names the bad field."""
    if fmt not in FORMATS:
        raise InputError(f"unknown expert format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if kv not in KV_TYPES:
        raise InputError(f"unknown KV cache type {kv!r}; choose one of {', '.join(KV_TYPES)}")
    cfg = Config(fmt, policy, kv)
    cfg.quant_policy  # raises FormatError for a format the toolkit does not know
    return cfg


def parse_configs(n, rows: list[tuple]) -> list[Config]:
    """The first ``n`` (2..4) of the page's configuration rows."""
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise InputError(f"number of configurations must be 2, 3 or 4, got {n!r}") from None
    if not 2 <= n <= min(4, len(rows)):
        raise InputError(f"number of configurations must be 2, 3 or 4, got {n}")
    return [parse_config(*r) for r in rows[:n]]


def parse_count(value, name: str, lo: int, hi: int) -> int:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(f) or f != int(f) or not lo <= f <= hi:
        raise InputError(f"{name} must be a whole number in [{lo}, {hi}], got {value}")
    return int(f)


def context_limit(model_dir) -> int:
    """The context the app allows: the training context when the checkpoint records one, else the config's."""
    d = Path(model_dir)
    try:
        ctx = int(json.loads((d / "training_report.json").read_text())["args"]["ctx"])
    except (OSError, KeyError, TypeError, ValueError):
        ctx = None
    try:
        max_pos = int(json.loads((d / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, TypeError, ValueError):
        max_pos = 2048
    return min(ctx, max_pos) if ctx else max_pos
