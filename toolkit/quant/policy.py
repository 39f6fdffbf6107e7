"""A policy maps each weight of a model to a format (or to "keep full precision").

Weights are named by *role* (``moe.gate_up``, ``moe.down``, ``attn.q`` ... as ``toolkit.model.weights``
yields them), by canonical name ``layers.{i}.{role}`` and by checkpoint name
(``model.layers.3.block_sparse_moe.experts.*.w2``). Presets name the roles they quantize:

- ``moqe``: the routed experts' gate/up/down only (MoQE, arXiv 2310.02410); attention, router, shared
  experts, embeddings and LM head keep full precision.
- ``all-linear``: experts, shared experts, dense MLPs and attention projections; router, embeddings, head kept.
- ``none``: nothing quantized.

Overrides (``regex=format``, first match wins, ``none`` keeps full precision) apply to the linear roles;
the regex is searched in both the canonical and the checkpoint name, e.g. ``down=int8`` or ``w2=int8``.
One routed expert's projection is also named ``layers.{i}.{role}.{e}`` (``layers.3.moe.down.5``; checkpoint
name with the expert number), so an override can pick single experts (``moe.down.[0-3]$=int8``).

A plan (``toolkit/quant/plan.py``, ``moqe plan``) names every expert projection exactly, one
``layers.{i}.{role}.{e}=FORMAT`` line each; it is looked up before the overrides. Experts of one weight at
different formats are stored as :class:`~toolkit.formats.mixed.MixedExperts`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import FormatError
from ..formats import Format, get_format

EXPERT_ROLES = ("moe.gate_up", "moe.down")
LINEAR_ROLES = EXPERT_ROLES + ("moe.shared_gate_up", "moe.shared_down", "mlp.gate_up", "mlp.down",
                               "attn.q", "attn.k", "attn.v", "attn.o", "attn.q_a", "attn.q_b", "attn.kv_a")
# MLA's kv_b (the per-head key / value up-projections) stays dense: decode absorbs it into the query and output
PRESETS = {"none": (), "moqe": EXPERT_ROLES, "all-linear": LINEAR_ROLES}


@dataclass(frozen=True)
class Policy:
    preset: str = "none"
    format: Format | None = None  # the format of the preset's roles
    overrides: tuple[tuple[str, Format | None], ...] = field(default_factory=tuple)
    auto_group: bool = False  # the format was named without a group size: ``fit`` may pick another one
    plan: tuple[tuple[str, Format | None], ...] = ()  # exact names ``layers.{i}.{role}.{e}`` (a plan file), first
    plan_label: str = ""  # names the plan in the label (its file and digest)
    imatrix: dict | None = field(default=None, compare=False, repr=False)  # (layer, proj, e) -> importance [K]
    imatrix_label: str = ""  # names the importance file in the label

    def importance(self, role: str, layer: int | None, e: int):
        """The calibrated importance of expert ``e``'s projection (None: round-to-nearest scales)."""
        if not self.imatrix or layer is None or role not in EXPERT_ROLES:
            return None
        return self.imatrix.get((layer, role.split(".")[1], e))

    @cached_property
    def _plan(self) -> dict:
        return dict(self.plan)

    def format_for(self, role: str, name: str, layer: int | None = None, expert: int | None = None) -> Format | None:
        """The format of one weight (of one expert of a stacked expert weight), or None to keep it in full precision."""
        if role not in LINEAR_ROLES:
            return None
        canonical = f"layers.{layer}.{role}" if layer is not None else role
        names = (canonical, name)
        if expert is not None:  # the expert's own names first, then the whole weight's
            one = f"{canonical}.{expert}"
            if one in self._plan:
                return self._plan[one]
            names = (one, name.replace("*", str(expert))) + names
        for pattern, fmt in self.overrides:
            if any(re.search(pattern, n) for n in names):
                return fmt
        return self.format if role in PRESETS[self.preset] else None

    def expert_formats(self, role: str, name: str, layer: int, n: int) -> list[Format | None]:
        """The format of each of the ``n`` experts of a stacked expert weight (a plan or an override may tell
        them apart)."""
        if not (self.plan or self.overrides) or role not in EXPERT_ROLES:
            return [self.format_for(role, name, layer)] * n
        return [self.format_for(role, name, layer, e) for e in range(n)]

    def fit(self, cfg) -> tuple["Policy", str | None]:
        """With a format named without a group size (``int3``) whose default group size does not divide every
        inner dimension the policy quantizes in ``cfg``, pick the largest of its group sizes that does;
        returns (policy, a note saying which when it is not the default). A group size the user named is kept (the quantizer then names the ones that fit)."""
        fmt = self.format
        if not self.auto_group or fmt is None or not fmt.group_sizes:
            return self, None
        dims = {cfg.hidden_size: "hidden size", cfg.expert_intermediate: "expert intermediate size"}
        if self.preset == "all-linear" and cfg.mla is not None:  # inner dims of q_b and o_proj
            dims |= {cfg.num_heads * cfg.mla.v_head_dim: "attention width (heads x v_head_dim)"}
            if cfg.mla.q_lora_rank:
                dims |= {cfg.mla.q_lora_rank: "q_lora_rank"}
        elif self.preset == "all-linear":
            dims |= {cfg.num_heads * cfg.head_dim: "attention width"}
        if self.preset == "all-linear":
            if cfg.shared_intermediate:
                dims |= {cfg.shared_intermediate: "shared expert size"}
            if not all(cfg.moe_layers):
                dims |= {cfg.dense_intermediate: "dense MLP size"}
        fits = [g for g in sorted(fmt.group_sizes, reverse=True) if all(d % g == 0 for d in dims)]
        if not fits:
            raise FormatError(f"format {fmt.name!r}: none of its group sizes ({', '.join(map(str, fmt.group_sizes))}) "
                              f"divides every dimension to quantize ({', '.join(f'{v} {d}' for d, v in dims.items())})")
        if fmt.group_size in fits:  # the default fits: keep it
            return dataclasses.replace(self, auto_group=False), None
        why = next(f"{v} {d}" for d, v in dims.items() if d % fmt.group_size)
        picked = fmt.with_group_size(fits[0])
        note = (f"{fmt.name}: using {picked.spec} (the default group size {fmt.group_size} does not divide the {why}; "
                f"the largest that divides every dimension is {fits[0]})")
        return dataclasses.replace(self, format=picked, auto_group=False), note

    @property
    def label(self) -> str:
        if self.preset == "none" or self.format is None:
            base = "none"
        else:
            base = f"{self.preset}:{self.format.spec}"
        extra = ",".join(f"{p}={f.spec if f else 'none'}" for p, f in self.overrides)
        if self.plan:
            extra = ",".join(filter(None, [f"plan={self.plan_label}", extra]))
        if self.imatrix:
            extra = ",".join(filter(None, [extra, f"imatrix={self.imatrix_label}"]))
        return f"{base}[{extra}]" if extra else base


def parse_policy(preset: str = "none", fmt: str | None = None, overrides: list[str] | tuple = ()) -> Policy:
    """``parse_policy('moqe', 'int3-g64', ['down=int4'])``; raises FormatError on unknown names or bad regexes."""
    if preset not in PRESETS:
        raise FormatError(f"unknown policy {preset!r}; choose one of {', '.join(PRESETS)}")
    f = None
    if preset != "none":
        if not fmt:
            raise FormatError(f"policy {preset!r} needs a format (e.g. int4, int3-g64, fp8)")
        f = get_format(fmt)
    auto = f is not None and bool(f.group_sizes) and not re.search(r"-g\d+$", str(fmt).strip().lower())
    parsed = []
    for item in overrides or ():
        pattern, sep, spec = str(item).rpartition("=")
        if not sep or not pattern:
            raise FormatError(f"override {item!r} must look like REGEX=FORMAT (e.g. 'down=int8')")
        try:
            re.compile(pattern)
        except re.error as e:
            raise FormatError(f"override {item!r}: bad regular expression ({e})") from None
        parsed.append((pattern, None if spec.strip().lower() in ("none", "f32") else get_format(spec)))
    return Policy(preset, f, tuple(parsed), auto)
