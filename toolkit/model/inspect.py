"""Parameter counts and bytes of a checkpoint, split into experts / attention / other (no weights loaded)."""
from __future__ import annotations

import os

import numpy as np

from ..errors import FormatError, ModelError

from .checkpoint import Checkpoint
from .config import ModelConfig


def classify(name: str, cfg: ModelConfig) -> str:
    """'experts' for routed expert weights, 'attention' for attention projections, else 'other'."""
    if ".experts." in name and ".shared_expert" not in name:
        return "experts"
    if ".self_attn." in name:
        return "attention"
    return "other"


def parts(cfg: ModelConfig) -> list[dict]:
    """The model's parts as the family names them (attention, router, experts, layers, rope): ``moqe info``."""
    f = cfg.family
    attention = f.attention.describe(cfg)
    windows = sorted({w for w in cfg.sliding_window if w})
    if windows:
        attention += f", sliding window {'/'.join(map(str, windows))} on {sum(1 for w in cfg.sliding_window if w)} layers"
    return [{"part": k, "kind": v} for k, v in (("attention", attention), ("router", f.router.describe(cfg)),
                                                 ("experts", f.experts.describe(cfg)), ("layers", f.layers.describe(cfg)),
                                                 ("rope", f.rope.describe(cfg)))]


def parameter_summary(ck: Checkpoint, cfg: ModelConfig) -> list[dict]:
    totals: dict[str, list[int]] = {"experts": [0, 0], "attention": [0, 0], "other": [0, 0]}
    for name in ck.keys():
        a = ck.get(name)
        part = classify(name, cfg)
        totals[part][0] += int(np.prod(a.shape))
        totals[part][1] += int(a.nbytes)
    n_all = sum(v[0] for v in totals.values())
    rows = [{"part": k, "parameters": v[0], "share": f"{100 * v[0] / max(1, n_all):.1f} %", "bytes stored": v[1]}
            for k, v in totals.items()]
    rows.append({"part": "total", "parameters": n_all, "share": "100 %", "bytes stored": sum(v[1] for v in totals.values())})
    return rows


def parameter_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters the config implies, split into experts / attention / other (from the config alone): each part
    counts its own."""
    f, D, n_moe = cfg.family, cfg.hidden_size, sum(cfg.moe_layers)
    experts, block = f.experts.parameters(cfg)  # per routed layer: routed experts, the shared expert
    other = cfg.vocab_size * D * (1 if cfg.tie_word_embeddings else 2) + D + f.layers.parameters(cfg)
    other += n_moe * (block + f.router.parameters(cfg))
    return {"experts": n_moe * experts, "attention": f.attention.parameters(cfg), "other": other}


def estimate_bytes(cfg: ModelConfig, policy=None) -> int:
    """Bytes the runtime holds after loading with ``policy``: quantized weights at their format's size,
    everything else as f32 (an upper bound; the KV cache is not included)."""
    n = parameter_count(cfg)
    total = 4 * (n["attention"] + n["other"])
    fmt = policy.format_for("moe.gate_up", "experts", None) if policy is not None else None
    bits = 32.0
    if fmt is not None:
        try:
            bits = fmt.bits_per_weight((cfg.expert_intermediate, cfg.hidden_size))
        except FormatError:  # a shape the format cannot take is reported by the quantizer, not here
            bits = fmt.bits
    total += int(n["experts"] * bits / 8)
    return total


def memory_limit() -> int:
    """This machine's memory in bytes (the cgroup limit when one is set and lower)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        text = open("/sys/fs/cgroup/memory.max").read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total


def check_fits(cfg: ModelConfig, policy, source) -> None:
    """Refuse a model whose estimated size exceeds this machine's memory, before anything is allocated."""
    need, have = estimate_bytes(cfg, policy), memory_limit()
    if need > have:
        n = sum(parameter_count(cfg).values())
        raise ModelError(f"{source}: the config describes {n:,} parameters; loading them needs about "
                         f"{need / 1e9:,.1f} GB, more than this machine's {have / 1e9:.1f} GB (check num_hidden_layers, "
                         f"hidden_size and the expert sizes, or quantize the experts to fewer bits)")


INFO_FORMATS = ("q4_0", "q8_0", "int4-g128", "int8", "q4_k")  # the expert formats `moqe info` sizes


def packed_bytes(fmt, n: int, k: int, mapped: bool = False, activations: str | None = None) -> int:
    """Bytes the Numba kernels hold for an ``[n, k]`` weight in ``fmt``, from a packed sample row: its packed
    layout (equal to the stored one for q4_0 / q8_0 / int*, larger where codes are widened: q5 / k-quants), plus
    the stored copy where the packing neither views it nor can rebuild it (k-quants quantized here; a ``mapped``
    file's pages are handed back instead)."""
    from ..cpu import api as cpu

    dec = cpu.decoder_for(fmt)
    row = fmt.quantize(np.zeros((2, k), np.float32), "numpy", name="sample")  # 2 rows: a 1-element slice is
    if cpu.int8_applies(row, cpu.check_activations(activations)):  # int8 activations: the integer kernels' packing only (the stored copy dropped or
        p = cpu.pack_int(fmt.quantize(np.zeros((32, k), np.float32), "numpy", name="sample"))  # handed back)
        return sum(a.nbytes for a in p.arrays) * n // 32  # (one tile of 32 rows)
    if dec is None:                                                           # contiguous, so it looks like a view
        return row.nbytes * n // 2
    packed = dec.pack(row)
    views = [any(np.may_share_memory(o, a) for a in row.arrays.values()) for o in packed]
    per_row = sum(o.nbytes for o, v in zip(packed, views) if not v)  # packed arrays of their own (2 rows)
    if any(views) or not (mapped or dec.unpack is not None):  # the stored arrays stay (read by the kernels, or kept)
        per_row += row.nbytes
    return per_row * n // 2


def resident_estimate(cfg: ModelConfig, formats=INFO_FORMATS, activations: str | None = None) -> list[dict]:
    """Expected resident bytes on the CPU (Numba backend) with the routed experts in each of ``formats`` (policy
    moqe): experts as the kernels hold them, attention / router / norms in f32, embeddings and head in the
    checkpoint's 16-bit type (f32 for an f32 checkpoint). The KV cache and the runtime (about 0.15 GB) come on top."""
    from ..formats import get_format

    counts = parameter_count(cfg)
    D, I, n_moe = cfg.hidden_size, cfg.expert_intermediate, sum(cfg.moe_layers)
    head = cfg.vocab_size * D * (1 if cfg.tie_word_embeddings else 2)
    from .runtime import DENSE16_MIN, format16

    wide = 2 if format16(cfg.torch_dtype) else 4

    big = D * cfg.num_heads * cfg.head_dim >= DENSE16_MIN  # (o's size; the q/k norms counted at that width too)
    attn = wide if cfg.family.attention.dense16 and big else 4
    rest = 4 * (counts["other"] - head) + attn * counts["attention"] + wide * head
    rows = []
    for spec in formats:
        try:
            fmt = get_format(spec)
            per_expert = (packed_bytes(fmt, 2 * I, D, activations=activations)
                          + packed_bytes(fmt, D, I, activations=activations))
        except (FormatError, ValueError) as e:  # a shape the format's blocks do not divide
            rows.append({"experts": spec, "experts GB": None, "rest GB": None, "total GB": None, "note": str(e)})
            continue
        experts = per_expert * cfg.num_experts * n_moe
        rows.append({"experts": spec, "experts GB": experts / 1e9, "rest GB": rest / 1e9,
                     "total GB": (experts + rest) / 1e9, "note": ""})
    return rows
