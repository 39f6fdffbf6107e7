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
    """The model's parts as the runtime composes them (attention, router, experts, layers, rope): ``moqe info``."""
    a = cfg.arch
    attention = {"gqa": "GQA", "gqa-qk-norm-head": "GQA, RMSNorm on each head's q and k",
                 "gqa-qk-norm-proj": "GQA, RMSNorm on the whole q and k projections", "mla": "MLA"}[a.attention]
    if a.attention == "gqa" and cfg.qk_norm == "head":
        attention += ", RMSNorm on each head's q and k"
    if cfg.mla is not None:
        m = cfg.mla
        attention += (f" (absorbed): {cfg.num_heads} heads of {m.qk_nope_head_dim} + rope {m.qk_rope_head_dim}, values "
                      f"{m.v_head_dim}; q {f'low-rank {m.q_lora_rank}' if m.q_lora_rank else 'one projection'}; "
                      f"the cache keeps latent {m.kv_lora_rank} + rope key {m.qk_rope_head_dim} per token"
                      + (", rope pairs interleaved" if m.rope_interleave else ""))
    if cfg.qkv_bias:
        attention += ", q/k/v" + ("/o" if a.o_bias else "") + " biases"
    if a.sinks:
        attention += ", attention sinks"
    if cfg.clip_qkv is not None:
        attention += f", q/k/v clipped to +-{cfg.clip_qkv:g}"
    windows = sorted({w for w in cfg.sliding_window if w})
    if windows:
        attention += f", sliding window {'/'.join(map(str, windows))} on {sum(1 for w in cfg.sliding_window if w)} layers"
    groups = (f" in the best {cfg.topk_group} of {cfg.n_group} groups" if cfg.n_group > 1 and cfg.topk_group < cfg.n_group else "")
    scaled = f", x{cfg.routed_scale:g}" if cfg.routed_scale != 1 else ""
    renorm = ", renormalised" if cfg.norm_topk_prob else " (not renormalised)"
    router = {"softmax": f"softmax, top-{cfg.top_k}{renorm}" + (", with a logit bias" if a.router_logit_bias else ""),
              "sigmoid-grouped": f"sigmoid with a selection bias, top-{cfg.top_k}{groups} (group score: its top two){renorm}{scaled}",
              "softmax-grouped": f"softmax, top-{cfg.top_k}{groups} (group score: its best){scaled}"}[a.router]
    shared = ""
    if cfg.shared_intermediate:
        shared = f", plus a shared expert ({cfg.shared_intermediate})" + (" with a sigmoid gate" if a.shared_gated else "")
    experts = "SwiGLU" + shared
    if cfg.expert_act is not None:
        _, alpha, limit = cfg.expert_act
        experts = f"clamped SwiGLU (alpha {alpha:g}, limit {limit:g}), biases on both projections" + shared
    dense = [i for i, m in enumerate(cfg.moe_layers) if not m]
    layers = f"{sum(cfg.moe_layers)} MoE" + (f", dense MLP at {dense}" if dense else "")
    rope = cfg.rope_type + (f" (scale {cfg.rope_params.get('factor')})" if cfg.rope_params.get("factor") else "")
    if cfg.rotary_dim:
        rope += f", on {cfg.rotary_dim} of {cfg.head_dim} head dims"
    return [{"part": k, "kind": v} for k, v in (("attention", attention), ("router", router), ("experts", experts),
                                                 ("layers", layers), ("rope", rope))]


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
    """Parameters the config implies, split into experts / attention / other (from the config alone)."""
    D, V, hd, H = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_heads
    attn = (2 * H * hd * D + 2 * cfg.num_kv_heads * hd * D) * cfg.num_layers
    if cfg.qkv_bias:
        attn += ((H + 2 * cfg.num_kv_heads) * hd + (D if cfg.arch.o_bias else 0)) * cfg.num_layers
    if cfg.arch.sinks:
        attn += H * cfg.num_layers
    if cfg.qk_norm:  # q_norm / k_norm weights: one head's width each, or the whole projections'
        attn += (2 * hd if cfg.qk_norm == "head" else (H + cfg.num_kv_heads) * hd) * cfg.num_layers
    if cfg.mla is not None:
        m = cfg.mla
        q = m.q_lora_rank * (D + H * m.qk_head_dim) if m.q_lora_rank else D * H * m.qk_head_dim
        kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        norms = m.q_lora_rank + m.kv_lora_rank
        attn = (q + kv + H * m.v_head_dim * D + norms) * cfg.num_layers
    n_moe = sum(cfg.moe_layers)
    experts = n_moe * cfg.num_experts * 3 * cfg.expert_intermediate * D
    if cfg.expert_act is not None:  # gpt-oss: a bias on each projection
        experts += n_moe * cfg.num_experts * (2 * cfg.expert_intermediate + D)
    other = V * D * (1 if cfg.tie_word_embeddings else 2) + D * (2 * cfg.num_layers + 1)
    other += n_moe * (cfg.num_experts * D + 3 * cfg.shared_intermediate * D
                      + (D if cfg.shared_intermediate and cfg.arch.shared_gated else 0)
                      + (cfg.num_experts if cfg.arch.select_bias_name or cfg.arch.router_logit_bias else 0))
    other += (cfg.num_layers - n_moe) * 3 * cfg.dense_intermediate * D
    return {"experts": experts, "attention": attn, "other": other}


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
    attn = wide if cfg.arch.attention != "mla" and big else 4
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
