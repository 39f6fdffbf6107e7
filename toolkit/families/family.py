"""The family record: a name and its parts, plus the few rules a family genuinely owns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .parts import Part
from .parts.layers import AllMoE
from .parts.rope import Rope


@dataclass(frozen=True)
class Family:
    """One MoE family. ``name``: the class name in config.json's "architectures"; ``gguf``: llama.cpp's
    ``general.architecture`` for it (None: no GGUF). Families sharing a GGUF name are told apart by their router's
    gating function (deepseek2: DeepSeek-V3 sigmoid, V2 softmax). ``gguf_rule(m, raw)``: the family's own GGUF
    rule, run after its parts'."""

    name: str
    attention: Part
    router: Part
    experts: Part
    layers: Part = AllMoE()
    rope: Part = Rope()
    gguf: str | None = None
    gguf_rule: Callable | None = None

    @property
    def parts(self) -> tuple:
        """Every part, sub-parts (the shared expert) included, in the order the config is read."""
        return (self.experts, *getattr(self.experts, "subparts", ()), self.attention, self.router, self.layers, self.rope)

    @property
    def compiled(self) -> bool:
        """Whether the compiled decode step covers every part of this family (each part says so of itself)."""
        return all(p.compiled for p in self.parts)

    def layer_names(self, i: int) -> dict:
        """Our role -> the family's GGUF tensor name in layer i."""
        return {role: t.format(i=i) for part in self.parts for role, t in part.gguf_names.items()}
